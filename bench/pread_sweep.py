"""Sweep the pread reader's knobs against mx.load, each run in a fresh process.

    python bench/pread_sweep.py [CHECKPOINT] [--reps 3] [--threads 1,2,4]
        [--chunks 4,16,64] [--backends threads,io_uring] [--caches warm,cold]

Prints, per cache state, the median / min / max time to a materialized dict and
the median system time and minor page faults of the timed part, for mx.load
and every (backend, threads, chunk MiB) combination. Runs are interleaved
(every configuration once per repetition) so slow phases of the machine hit
all of them alike. Default checkpoint: the cached 1 GiB synthetic aligned one.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from pyloader import MeasureError
from pyloader.bench.harness import measure_once
from pyloader.bench.synthetic import synthetic_pair


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=_ints, default=[1, 2, 4])
    p.add_argument("--chunks", type=_ints, default=[4, 16, 64], help="MiB")
    p.add_argument("--backends", default="threads,io_uring")
    p.add_argument("--caches", default="warm,cold")
    args = p.parse_args(argv)
    path = args.checkpoint or synthetic_pair()["safetensors"]

    configs: list[tuple] = [("mlx", None, None, None)]
    for backend in args.backends.split(","):
        threads = args.threads if backend == "threads" else [None]
        configs += [("pread", backend, t, c) for t in threads for c in args.chunks]
    print(f"{path}: {len(configs)} configurations x {args.reps} reps", file=sys.stderr)
    for cache in args.caches.split(","):
        res: dict[tuple, list[dict]] = {}
        for rep in range(args.reps):
            for cfg in configs:
                strategy, backend, threads, chunk = cfg
                try:
                    r = measure_once(path, strategy, cache, stop_after="dict", threads=threads,
                                     chunk_bytes=chunk << 20 if chunk else None,
                                     backend=backend)
                except MeasureError as exc:
                    print(f"{cfg}: {str(exc).splitlines()[0]}", file=sys.stderr)
                    continue
                res.setdefault(cfg, []).append(r)
                print(f"  {cache} rep {rep + 1} {cfg}: {r['t_dict']:.3f} s", file=sys.stderr,
                      flush=True)
        print(f"\n{cache} page cache: time to dict (s) over {args.reps} reps")
        print(f"{'reader':<28} {'median':>7} {'min':>7} {'max':>7} {'stime':>6} {'minflt':>8}")
        for cfg, rs in res.items():
            strategy, backend, threads, chunk = cfg
            name = ("mx.load" if strategy == "mlx" else
                    f"pread {backend}" + (f" x{threads}" if threads else "") + f" {chunk} MiB")
            ts = [r["t_dict"] for r in rs]
            print(f"{name:<28} {statistics.median(ts):7.3f} {min(ts):7.3f} {max(ts):7.3f} "
                  f"{statistics.median(r['usage_dict']['stime'] for r in rs):6.2f} "
                  f"{int(statistics.median(r['usage_dict']['minflt'] for r in rs)):8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
