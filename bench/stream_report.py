"""Table and targets of `pytest bench/test_streaming_bench.py --benchmark-json=FILE`.

A command-line front of :mod:`pyloader.bench.suites.stream_report` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import stream_report

if __name__ == "__main__":
    sys.exit(stream_report.main())
