"""Read bounds: read(), mx.load and pread per thread count and chunk size.

A command-line front of :mod:`pyloader.bench.suites.pread_sweep` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import pread_sweep

if __name__ == "__main__":
    sys.exit(pread_sweep.main())
