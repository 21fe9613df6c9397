"""The CPU kernels against llama.cpp on the same weights.

A command-line front of :mod:`pyloader.bench.suites.llamacpp` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import llamacpp

if __name__ == "__main__":
    sys.exit(llamacpp.main())
