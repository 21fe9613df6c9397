"""Distributed benchmark: pipeline and tensor-parallel suites on two ranks.

A command-line front of :mod:`pyloader.bench.suites.distributed` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import distributed

if __name__ == "__main__":
    sys.exit(distributed.main())
