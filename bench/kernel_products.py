"""One prefill-sized product at every SIMD level of pyloader's CPU kernels.

The same inputs (random, seed 0) through ``core.cpu_quantized_matmul`` (4-bit, groups of
64, scales of the activations' dtype) and ``core.cpu_dense_matmul`` at each level this
CPU has, the levels interleaved in every round; GFLOP/s of wall time (2 * rows * n * k
over the median of ``--runs`` rounds), with the load average before and after. On a CPU
with AMX the ``amx`` row is the tile path (docs/kernels.md), the ``avx512`` row the
float32 panels it replaces.

    python bench/kernel_products.py                 # 5632 x 2048 at 256 rows
    python bench/kernel_products.py --n 2048 --k 5632 --rows 64

``--ggml`` times GGUF's block formats instead (``core.cpu_ggml_matmul`` on Q4_K, Q6_K and
Q8_0 bytes, random codes and finite scales) against the 4-bit affine kernel, at 1 row
(decode) and ``--rows`` (prefill), float16 activations:

    python bench/kernel_products.py --ggml
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


#: Bytes per block of 256 values and the offsets of each block's float16 scales.
GGML_LAYOUT = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,)), "Q8_0": (272, (0, 34, 68, 102,
                                                                        136, 170, 204, 238))}


def ggml_blocks(name: str, n: int, k: int):
    import mlx.core as mx
    import numpy as np

    size, halves = GGML_LAYOUT[name]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for off in halves:
        scale = (rng.standard_normal((n, k // 256)) * 0.01).astype(np.float16)
        blocks[:, :, off:off + 2] = scale.view(np.uint8).reshape(n, -1, 2)
    return mx.array(blocks.reshape(n, -1))


def measure_ggml(n: int, k: int, rows_list: list[int], runs: int) -> list[dict]:
    import mlx.core as mx

    from pyloader import cpu_kernels

    mx.random.seed(0)
    w = mx.random.normal((n, k)).astype(mx.float16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    weights = {name: ggml_blocks(name, n, k) for name in GGML_LAYOUT}
    mx.eval(q, s, b, *weights.values())
    out = []
    levels = list(cpu_kernels.kernel_isas())
    before = cpu_kernels.kernel_isa()
    for rows in rows_list:
        x = mx.random.normal((rows, k)).astype(mx.float16)
        mx.eval(x)
        products = {"4-bit": lambda x=x: cpu_kernels.cpu_quantized_matmul(x, q, s, b, 64, 4)}
        for name, blk in weights.items():
            products[name] = (lambda x=x, blk=blk, name=name:
                              cpu_kernels.cpu_ggml_matmul(x, blk, name, k))
        times = {(p, lv): [] for p in products for lv in levels}
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
            out.append({"activations": f"f16 x{rows}", "weights": p, "level": lv,
                        "ms": med * 1e3, "gflops": 2 * rows * n * k / med / 1e9})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ggml", action="store_true",
                    help="GGUF block formats (Q4_K, Q6_K, Q8_0) at 1 and --rows rows")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    if args.ggml:
        rows = measure_ggml(args.n, args.k, [1, args.rows], args.runs)
        shape = f"1 and {args.rows}"
    else:
        rows = measure(args.n, args.k, args.rows, args.runs)
        shape = str(args.rows)
    print(f"{shape} x {args.k} @ ({args.n} x {args.k}).T, medians of {args.runs}, "
          f"load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'activations':12} {'weights':8} {'level':9} {'ms':>8} {'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['activations']:12} {r['weights']:8} {r['level']:9} {r['ms']:8.2f} "
              f"{r['gflops']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
