"""Page-fault cost of the readers (mmap vs pread).

A command-line front of :mod:`pyloader.bench.suites.fault_emulation` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import fault_emulation

if __name__ == "__main__":
    sys.exit(fault_emulation.main())
