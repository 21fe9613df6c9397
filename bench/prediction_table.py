"""The planner's per-format machine table.

A command-line front of :mod:`pyloader.bench.suites.prediction_table` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import prediction_table

if __name__ == "__main__":
    sys.exit(prediction_table.main())
