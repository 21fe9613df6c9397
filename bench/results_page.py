"""docs/results.md from the kept summaries in bench/results/*.json.

A command-line front of :mod:`pyloader.bench.results` (``--help`` for options).
"""

import sys

from pyloader.bench import results

if __name__ == "__main__":
    sys.exit(results.main())
