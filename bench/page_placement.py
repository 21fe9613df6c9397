"""Decode products on weights as cached now, then after evicting and reading them back.

A command-line front of :mod:`pyloader.bench.suites.page_placement` (``--help``).
"""

import sys

from pyloader.bench.suites import page_placement

if __name__ == "__main__":
    sys.exit(page_placement.main())
