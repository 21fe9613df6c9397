"""What the expert caches' synchronisation costs per token.

A command-line front of :mod:`pyloader.bench.suites.experts_sync_cost` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import experts_sync_cost

if __name__ == "__main__":
    sys.exit(experts_sync_cost.main())
