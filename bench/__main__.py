"""``python -m bench ...``: the benchmark's command line (see :mod:`bench.cli` or ``--help``)."""

import sys

from bench.cli import main

sys.exit(main())
