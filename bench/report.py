"""Markdown tables of `pytest bench/ --benchmark-json=FILE`.

A command-line front of :mod:`pyloader.bench.suites.load_report` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import load_report

if __name__ == "__main__":
    sys.exit(load_report.main())
