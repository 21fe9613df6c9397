"""One prefill-sized product at every SIMD level of the CPU kernels.

A command-line front of :mod:`pyloader.bench.suites.kernel_products` (``--help``).
"""

import sys

from pyloader.bench.suites import kernel_products

if __name__ == "__main__":
    sys.exit(kernel_products.main())
