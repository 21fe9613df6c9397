"""Residency planner: predicted against measured speed and memory.

A command-line front of :mod:`pyloader.bench.suites.prediction` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import prediction

if __name__ == "__main__":
    sys.exit(prediction.main())
