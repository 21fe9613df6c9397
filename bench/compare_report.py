"""The table of `pytest bench/test_compare_bench.py --benchmark-json=FILE`.

A command-line front of :mod:`pyloader.bench.suites.compare_report` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import compare_report

if __name__ == "__main__":
    sys.exit(compare_report.main())
