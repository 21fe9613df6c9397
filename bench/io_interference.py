"""Streaming decode next to other disk readers.

A command-line front of :mod:`pyloader.bench.suites.io_interference` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import io_interference

if __name__ == "__main__":
    sys.exit(io_interference.main())
