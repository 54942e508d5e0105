"""Debian's chromium for the benches that drive a real browser (Playwright), and its launch flags.

The browser tests take them from here too (``tests/_browser.py``). The path comes from ``CHROMIUM_PATH``
(a setting of the tests and benches, not of the engine), default ``/usr/bin/chromium``.
"""

from __future__ import annotations

import os

CHROMIUM = os.environ.get("CHROMIUM_PATH") or "/usr/bin/chromium"  # Debian's package
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
