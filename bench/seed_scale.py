"""A model larger than memory, end to end, in a memory cgroup.

A command-line front of :mod:`pyloader.bench.suites.seed_scale` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import seed_scale

if __name__ == "__main__":
    sys.exit(seed_scale.main())
