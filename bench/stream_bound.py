"""Streaming decode against the disk's read bound.

A command-line front of :mod:`pyloader.bench.suites.stream_bound` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import stream_bound

if __name__ == "__main__":
    sys.exit(stream_bound.main())
