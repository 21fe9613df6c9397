"""The steps between a decode step's products, at every SIMD level of pyloader's CPU kernels.

Per-call time of RMSNorm, RoPE, SwiGLU and attention at the 1.1B shape's decode sizes
(hidden 2048, 32 query and 4 key/value heads of 64, ffn 5632; float16), through
``core.cpu_*`` at each level this CPU has and through MLX's own ops: each a chain of
``--chain`` calls, each feeding the next, evaluated at once (so a call's cost includes
MLX's dispatch of one op, as in a model's graph), median of ``--runs`` rounds with the
levels interleaved, and the load average before and after.

    python bench/decode_steps.py
    python bench/decode_steps.py --context 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _steps(context: int) -> dict:
    """name -> (pyloader's call, MLX's call, input): each maps an array to one of its shape."""
    import mlx.core as mx
    from mlx import nn

    from pyloader import cpu_kernels

    mx.random.seed(0)
    f16 = mx.float16

    def rand(shape):
        return (mx.random.normal(shape) * 0.1).astype(f16)

    x, w, h = rand((1, 1, 2048)), mx.ones((2048,), f16), rand((1, 1, 5632))
    q = rand((1, 32, 1, 64))
    k, v = rand((1, 4, context, 64)), rand((1, 4, context, 64))
    mx.eval(x, w, h, q, k, v)
    return {
        "rms_norm 2048": (lambda y: cpu_kernels.cpu_rms_norm(y, w, 1e-5),
                          lambda y: mx.fast.rms_norm(y, w, 1e-5), x),
        "rope 32 x 64": (lambda t: cpu_kernels.cpu_rope(t, 64, False, 10000.0, 1.0, 10),
                         lambda t: mx.fast.rope(t, 64, traditional=False, base=10000.0,
                                                scale=1.0, offset=10), q),
        "swiglu 5632": (lambda y: cpu_kernels.cpu_swiglu(y, h), lambda y: nn.silu(y) * h, h),
        f"attention kv={context}": (
            lambda t: cpu_kernels.cpu_attention(t, k, v, 0.125),
            lambda t: mx.fast.scaled_dot_product_attention(t, k, v, scale=0.125), q),
    }


def _chain(f, x, n: int) -> float:
    import mlx.core as mx

    t = time.perf_counter()
    y = x
    for _ in range(n):
        y = f(y)
    mx.eval(y)
    return (time.perf_counter() - t) / n


def measure(context: int, chain: int, runs: int) -> list[dict]:
    from pyloader import cpu_kernels

    steps = _steps(context)
    levels = list(cpu_kernels.kernel_isas())
    times: dict = {}
    before = cpu_kernels.kernel_isa()
    try:
        for r in range(runs + 1):  # the first round warms up
            for name, (ours, theirs, x) in steps.items():
                for lv in levels:
                    cpu_kernels.set_kernel_isa(lv)
                    t = _chain(ours, x, chain)
                    if r:
                        times.setdefault((name, lv), []).append(t)
                t = _chain(theirs, x, chain)
                if r:
                    times.setdefault((name, "mlx"), []).append(t)
    finally:
        cpu_kernels.set_kernel_isa(before)
    return [{"step": name, "by": by, "us": statistics.median(ts) * 1e6}
            for (name, by), ts in times.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=256, help="keys and values attended")
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    load = os.getloadavg()
    rows = measure(args.context, args.chain, args.runs)
    print(f"float16, chains of {args.chain}, medians of {args.runs}, "
          f"load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'step':22} {'by':9} {'us a call':>10}")
    for r in rows:
        print(f"{r['step']:22} {r['by']:9} {r['us']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
