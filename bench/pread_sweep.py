"""Sweep the pread reader's knobs against mx.load, each run in a fresh process.

    python bench/pread_sweep.py [CHECKPOINT] [--reps 3] [--threads 1,2,4]
        [--chunks 4,16,64] [--backends threads,io_uring] [--caches warm,cold]

Prints, per cache state, the median / min / max time to a materialized dict and
the median system time and minor page faults of the timed part, for mx.load,
every (backend, threads, chunk MiB) combination and two bounds without arrays or
fresh pages: plain sequential ``read()`` of every file into one reused 16 MiB buffer
(the simplest bound), and 2 MiB ``pread``s over one thread per core into reused buffers.
Runs are interleaved (every configuration once per repetition) so slow phases of
the machine hit all of them alike; each pread configuration's speed is then given
as the median over repetitions of its ratio to mx.load and to the bound in the
same repetition. Default checkpoint: the cached 1 GiB synthetic aligned one.
With ``--json FILE`` the runs and ratios are written too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from pyloader.errors import MeasureError
from pyloader.compare.harness import measure_once
from benchlib.synthetic import synthetic_pair


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
    p.add_argument("--json", default=None, help="write runs and ratios here")
    args = p.parse_args(argv)
    load = os.getloadavg()
    path = args.checkpoint or synthetic_pair()["safetensors"]

    configs: list[tuple] = [("read", None, None, None), ("mlx", None, None, None),
                            ("read-parallel", None, None, None)]
    for backend in args.backends.split(","):
        threads = args.threads if backend == "threads" else [None]
        configs += [("pread", backend, t, c) for t in threads for c in args.chunks]
    print(f"{path}: {len(configs)} configurations x {args.reps} reps", file=sys.stderr)
    report = {"path": path, "reps": args.reps, "loadavg_before": load, "caches": {}}
    for cache in args.caches.split(","):
        res: dict[tuple, list[dict]] = {}
        by_rep: list[dict[tuple, float]] = []
        for rep in range(args.reps):
            by_rep.append({})
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
                by_rep[-1][cfg] = r["t_dict"]
                print(f"  {cache} rep {rep + 1} {cfg}: {r['t_dict']:.3f} s", file=sys.stderr,
                      flush=True)
        rows = {}
        for cfg, rs in res.items():
            rows[_name(cfg)] = {"t_dict": [r["t_dict"] for r in rs],
                                "stime": [r["usage_dict"]["stime"] for r in rs],
                                "minflt": [r["usage_dict"]["minflt"] for r in rs]}
        refs = {"vs_mlx": configs[1], "vs_read": configs[0], "vs_parallel": configs[2]}
        ratios = {_name(cfg): {key: [rep[ref] / rep[cfg] for rep in by_rep
                                     if cfg in rep and ref in rep]
                               for key, ref in refs.items()}
                  for cfg in configs[1:]}
        nbytes = res[configs[0]][0]["bytes"] if res.get(configs[0]) else None
        report["caches"][cache] = {"rows": rows, "ratios": ratios, "bytes": nbytes}
    report["loadavg_after"] = os.getloadavg()
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def table(report: dict) -> str:
    """Per page cache state: time to dict per reader (median, min, max, system time,
    minor faults), speed ratios against the references within each repetition, and the
    bounds' bandwidth."""
    med = statistics.median
    out = []
    for cache, c in report["caches"].items():
        out += [f"{cache} page cache: time to dict (s) over {report['reps']} reps",
                f"{'reader':<28} {'median':>7} {'min':>7} {'max':>7} {'stime':>6} {'minflt':>8}"]
        for name, r in c["rows"].items():
            ts = r["t_dict"]
            out.append(f"{name:<28} {med(ts):7.3f} {min(ts):7.3f} {max(ts):7.3f} "
                       f"{med(r['stime']):6.2f} {int(med(r['minflt'])):8d}")
        out.append(f"speed ratios, median over reps (same rep): {'vs mx.load':>11} "
                   f"{'vs read()':>10} {'vs 2MiB-reused':>15}")
        for name, got in c["ratios"].items():
            if all(got.values()):
                out.append(f"{name:<43} {med(got['vs_mlx']):11.2f} {med(got['vs_read']):10.2f} "
                           f"{med(got['vs_parallel']):15.2f}")
        if c.get("bytes"):
            for name in ("read() 16 MiB (bound)", "pread 2 MiB, reused buffers"):
                if name in c["rows"]:
                    out.append(f"{name}: {c['bytes'] / 1e9 / med(c['rows'][name]['t_dict']):.2f}"
                               " GB/s (median)")
        out.append("")
    return "\n".join(out).rstrip("\n")


def _name(cfg: tuple) -> str:
    strategy, backend, threads, chunk = cfg
    if strategy == "read":
        return "read() 16 MiB (bound)"
    if strategy == "read-parallel":
        return "pread 2 MiB, reused buffers"
    if strategy == "mlx":
        return "mx.load"
    return f"pread {backend}" + (f" x{threads}" if threads else "") + f" {chunk} MiB"


if __name__ == "__main__":
    sys.exit(main())
