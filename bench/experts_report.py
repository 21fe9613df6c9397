"""Tables and plot of `pytest bench/test_experts_bench.py --benchmark-json=FILE`.

A command-line front of :mod:`pyloader.bench.suites.experts_report` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import experts_report

if __name__ == "__main__":
    sys.exit(experts_report.main())
