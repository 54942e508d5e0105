"""Debian's chromium for the benches that drive a real browser (Playwright), and its launch flags.

The tests keep the same few lines in ``tests/_browser.py`` (nothing imports ``bench``, and ``bench`` imports
no test module): the path comes from ``CBP_CHROMIUM`` in both, default ``/usr/bin/chromium``.
"""

from __future__ import annotations

import os

CHROMIUM = os.environ.get("CBP_CHROMIUM", "/usr/bin/chromium")  # Debian's package
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
