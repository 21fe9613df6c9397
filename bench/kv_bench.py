"""KV cache: memory and speed against mlx-lm's cache, per context.

A command-line front of :mod:`pyloader.bench.suites.kv` (``--help`` for options).
"""

import sys

from pyloader.bench.suites import kv

if __name__ == "__main__":
    sys.exit(kv.main())
