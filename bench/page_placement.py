"""Decode products on a checkpoint's weights as the page cache holds them now, then after
the files are evicted and read back.

    python bench/page_placement.py MODEL_DIR [--rounds 3]

Every 2-D float16/bfloat16 weight of the checkpoint, mapped zero-copy (``MmapReader``),
goes through one decode product (``core.cpu_dense_matmul``, one activation row) in
checkpoint order; a round is all of them, timed as one. Then every file is evicted
(``posix_fadvise(DONTNEED)``) and read back (``pagecache.recache``), and the same rounds
run again. Prints the GB/s of weights streamed, the median round of each state (after one
untimed round that maps the pages in). The two differ when where the page cache put a
file's pages matters: on this project's VM, pages a file had held for hours read markedly
slower than pages just cached (docs/kernels.md); llama.cpp comparisons therefore re-cache
every file before each measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def rounds_gbs(weights: list, rounds: int) -> list[float]:
    """GB/s of each of ``rounds`` passes of one decode product over every weight."""
    import mlx.core as mx

    from pyloader import cpu_kernels

    xs = {}
    for w in weights:
        k = w.shape[1]
        if (k, w.dtype) not in xs:
            xs[(k, w.dtype)] = mx.random.normal((1, k)).astype(w.dtype)
    mx.eval(list(xs.values()))
    nbytes = sum(w.nbytes for w in weights)
    out = []
    for i in range(rounds + 1):  # the first round maps the pages in, untimed
        t = time.perf_counter()
        mx.eval([cpu_kernels.cpu_dense_matmul(xs[(w.shape[1], w.dtype)], w) for w in weights])
        if i:
            out.append(nbytes / (time.perf_counter() - t) / 1e9)
    return out


def measure(model: Path, rounds: int) -> dict:
    import mlx.core as mx

    from pyloader.io import pagecache
    from pyloader.io.readers import MmapReader

    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model}: no .safetensors files")
    result = {}
    for state in ("as cached", "re-cached"):
        if state == "re-cached":
            pagecache.recache(files)
        weights = []
        readers = [MmapReader(f) for f in files]
        try:
            for r in readers:
                arrays = r.load()
                weights += [a for a in arrays.values()
                            if a.ndim == 2 and a.dtype in (mx.float16, mx.bfloat16)]
            if not weights:
                raise SystemExit(f"{model}: no 2-D float16/bfloat16 weights")
            result[state] = rounds_gbs(weights, rounds)
            result["bytes"] = sum(w.nbytes for w in weights)
            del weights[:], arrays
        finally:
            for r in readers:
                r.close()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="an mlx-lm directory of float16/bfloat16 weights")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    r = measure(args.model, args.rounds)
    print(f"{args.model}: {r['bytes'] / 1e9:.2f} GB of weights, {args.rounds} rounds, "
          f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for state in ("as cached", "re-cached"):
        runs = " ".join(f"{x:.1f}" for x in r[state])
        print(f"  {state:10} median {statistics.median(r[state]):5.1f} GB/s  ({runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
