"""The steps between a decode step's products at every SIMD level of the CPU kernels.

A command-line front of :mod:`pyloader.bench.suites.decode_steps` (``--help``).
"""

import sys

from pyloader.bench.suites import decode_steps

if __name__ == "__main__":
    sys.exit(decode_steps.main())
