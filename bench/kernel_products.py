"""One prefill-sized product at every SIMD level of pyloader's CPU kernels.

The same inputs (random, seed 0) through ``core.cpu_quantized_matmul`` (4-bit, groups of
64, scales of the activations' dtype) and ``core.cpu_dense_matmul`` at each level this
CPU has, the levels interleaved in every round; GFLOP/s of wall time (2 * rows * n * k
over the median of ``--runs`` rounds), with the load average before and after. On a CPU
with AMX the ``amx`` row is the tile path (docs/kernels.md), the ``avx512`` row the
float32 panels it replaces.

    python bench/kernel_products.py                 # 5632 x 2048 at 256 rows
    python bench/kernel_products.py --n 2048 --k 5632 --rows 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def measure(n: int, k: int, rows: int, runs: int) -> list[dict]:
    import mlx.core as mx

    from pyloader import cpu_kernels

    mx.random.seed(0)
    out = []
    for dtype in (mx.float16, mx.bfloat16):
        x = mx.random.normal((rows, k)).astype(dtype)
        w = mx.random.normal((n, k)).astype(dtype)
        q, s, b = mx.quantize(w, group_size=64, bits=4)
        mx.eval(x, w, q, s, b)
        products = {"4-bit": lambda: cpu_kernels.cpu_quantized_matmul(x, q, s, b, 64, 4),
                    "dense": lambda: cpu_kernels.cpu_dense_matmul(x, w)}
        levels = list(cpu_kernels.kernel_isas())
        times = {(p, lv): [] for p in products for lv in levels}
        before = cpu_kernels.kernel_isa()
        try:
            for _ in range(runs):
                for p, f in products.items():
                    for lv in levels:
                        cpu_kernels.set_kernel_isa(lv)
                        t = time.perf_counter()
                        mx.eval(f())
                        times[(p, lv)].append(time.perf_counter() - t)
        finally:
            cpu_kernels.set_kernel_isa(before)
        for (p, lv), ts in times.items():
            med = statistics.median(ts)
            out.append({"activations": str(dtype).split(".")[-1], "weights": p, "level": lv,
                        "ms": med * 1e3, "gflops": 2 * rows * n * k / med / 1e9})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    load = os.getloadavg()
    rows = measure(args.n, args.k, args.rows, args.runs)
    print(f"{args.rows} x {args.k} @ ({args.n} x {args.k}).T, medians of {args.runs}, "
          f"load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'activations':12} {'weights':8} {'level':9} {'ms':>8} {'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['activations']:12} {r['weights']:8} {r['level']:9} {r['ms']:8.2f} "
              f"{r['gflops']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
