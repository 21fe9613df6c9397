"""First use of every tensor after load, per load strategy.

A command-line front of :mod:`pyloader.bench.suites.first_use` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import first_use

if __name__ == "__main__":
    sys.exit(first_use.main())
