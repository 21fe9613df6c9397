"""Swappable heads: swap cost, memory and token identity.

A command-line front of :mod:`pyloader.bench.suites.heads` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import heads

if __name__ == "__main__":
    sys.exit(heads.main())
