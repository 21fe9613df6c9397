"""Time until every byte of a checkpoint has been used, per loading strategy, each run in
a fresh process.

    python bench/first_use.py CHECKPOINT [--reps 5] [--caches cold,warm]
        [--strategies mlx,pread,pread-overlap,mmap,mmap-overlap] [--threads N]
        [--json bench/results/raw/first_use-NAME.json]

Every run is a fresh child (:mod:`pyloader.compare.protocol`, workload ``first_use``):
once its imports are done the checkpoint's files are evicted from the page cache
(``posix_fadvise(DONTNEED)``, ``cold``) or read once (``warm``), then the child loads
with one strategy and uses each tensor once in file order (a max over every byte,
evaluated per tensor), nothing evaluated in between: ``mx.load``'s lazy reads and the
overlapped loads (``overlap=True``) run beside the use, the eager ones before it. Per
repetition the disk's ceiling is measured too, as the faster of two raw reads of every
byte in 2 MiB ``pread``s over one thread per core, no arrays and no use: through the
page cache into reused buffers (the ``load`` workload's ``read-parallel`` bound, the
one ``bench/pread_sweep.py`` reports) and with direct I/O into reused huge-page buffers
(``read-direct``, what ``fio --direct=1`` measures; on this VM the faster one cold).

Runs are interleaved (each configuration once per repetition, strategies rotated) so
slow phases of the machine hit all alike. Printed per cache state: the median / min /
max ``t_all`` (and ``t_return``, ``t_first``), the median over repetitions of
``mx.load``'s ``t_all`` divided by the strategy's (speed relative to ``mx.load``: > 1 is
faster) and of the bound's time divided by the strategy's (share of the disk's ceiling).
Note the machine's load average with the figures: they mean nothing on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from pyloader.compare.harness import measure_once
from pyloader.compare.protocol import Child
from benchlib.paths import RAW
from benchlib.workloads.first_use import STRATEGIES
from pyloader.io.pagecache import CACHE_STATES, page_cache_fraction, prepare_cache
from benchlib.workloads import FIRST_USE

#: The raw reads whose faster one, per repetition, is the disk's ceiling.
BOUNDS = ("read-parallel", "read-direct")


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def run_once(path: str, strategy: str, cache: str, threads: int | None) -> dict:
    """One run of ``strategy`` in a fresh child with the page cache in state ``cache``."""
    args = [path, "--strategy", strategy] + (["--threads", str(threads)] if threads else [])
    with Child(FIRST_USE, args, label=f"first_use {strategy} on {path}") as child:
        ready = child.start()
        prepare_cache(cache, ready["files"])
        before = page_cache_fraction(path)
        result = child.go()
        result["page_cache_before"] = before
        return result


def summarize(runs: list[dict], strategies: list[str], caches: list[str]) -> dict:
    """Medians per (cache, strategy) and per-repetition ratios to mx.load and the bound."""
    out: dict = {}
    for cache in caches:
        mine = [r for r in runs if r["cache"] == cache]
        reps = sorted({r["rep"] for r in mine})
        bound: dict[int, float] = {}
        for r in mine:
            if r["strategy"] in BOUNDS:
                bound[r["rep"]] = min(bound.get(r["rep"], float("inf")), r["t_bound"])
        mlx = {r["rep"]: r["t_all"] for r in mine if r["strategy"] == "mlx"}
        rows = {}
        for s in strategies:
            rs = [r for r in mine if r["strategy"] == s]
            if not rs:
                continue
            t_all = [r["t_all"] for r in rs]
            row = {"runs": len(rs),
                   "t_all": {"median": statistics.median(t_all), "min": min(t_all),
                             "max": max(t_all)},
                   "t_return": statistics.median(r["t_return"] for r in rs),
                   "t_first": statistics.median(r["t_first"] for r in rs)}
            by_rep = {r["rep"]: r["t_all"] for r in rs}
            vs_mlx = [mlx[k] / by_rep[k] for k in reps if k in mlx and k in by_rep]
            vs_bound = [bound[k] / by_rep[k] for k in reps if k in bound and k in by_rep]
            row["speed_vs_mx_load"] = statistics.median(vs_mlx) if vs_mlx else None
            row["share_of_disk_ceiling"] = statistics.median(vs_bound) if vs_bound else None
            rows[s] = row
        for b in BOUNDS:
            times = [r["t_bound"] for r in mine if r["strategy"] == b]
            if times:
                rows[b] = {"runs": len(times), "t_bound": statistics.median(times)}
        if bound:
            rows["ceiling"] = {"runs": len(bound), "t_bound": statistics.median(bound.values())}
        out[cache] = rows
    return out


def print_table(summary: dict) -> None:
    for cache, rows in summary.items():
        print(f"\n{cache} page cache")
        print(f"  {'strategy':<15} {'t_all med':>10} {'min':>8} {'max':>8} {'t_return':>9} "
              f"{'t_first':>8} {'vs mx.load':>10} {'of ceiling':>10}")
        for s, row in rows.items():
            if s in BOUNDS or s == "ceiling":
                label = "disk ceiling" if s == "ceiling" else f"  bound {s}"
                print(f"  {label:<15} {row['t_bound']:>10.3f}")
                continue
            t = row["t_all"]
            ratio = row["speed_vs_mx_load"]
            share = row["share_of_disk_ceiling"]
            print(f"  {s:<15} {t['median']:>10.3f} {t['min']:>8.3f} {t['max']:>8.3f} "
                  f"{row['t_return']:>9.3f} {row['t_first']:>8.3f} "
                  f"{(f'{ratio:.2f}x' if ratio else '-'):>10} "
                  f"{(f'{share:.2f}' if share else '-'):>10}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a .safetensors file or a model directory")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--caches", default="cold,warm",
                   help=f"page-cache states, from {','.join(CACHE_STATES)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"from {','.join(STRATEGIES)}")
    p.add_argument("--threads", type=int, default=None,
                   help="pread reader threads (default: one per core)")
    p.add_argument("--no-bound", action="store_true", help="skip the disk-ceiling runs")
    p.add_argument("--json", default=None,
                   help="write runs and summary here (default: "
                        "bench/results/raw/first_use-<checkpoint name>.json)")
    args = p.parse_args(argv)

    path = os.path.abspath(args.checkpoint)
    caches, strategies = _list(args.caches), _list(args.strategies)
    for c in caches:
        if c not in CACHE_STATES:
            p.error(f"unknown cache state {c!r}")
    for s in strategies:
        if s not in STRATEGIES:
            p.error(f"unknown strategy {s!r}")
    configs = list(strategies) + ([] if args.no_bound else list(BOUNDS))
    load_before = os.getloadavg()
    runs: list[dict] = []
    for rep in range(args.reps):
        for cache in caches:
            k = rep % len(configs)
            for s in configs[k:] + configs[:k]:  # rotated: no strategy always first
                if s in BOUNDS:
                    r = measure_once(path, s, cache, threads=args.threads,
                                     stop_after="dict")
                    row = {"t_bound": r["t_dict"], "bytes": r["bytes"]}
                else:
                    r = run_once(path, s, cache, args.threads)
                    row = {k2: r[k2] for k2 in ("t_return", "t_first", "t_all", "bytes",
                                                "tensors", "page_cache_before")}
                runs.append({"rep": rep, "cache": cache, "strategy": s, **row})
                print(f"rep {rep} {cache:<4} {s:<14} "
                      + " ".join(f"{k2}={v:.3f}" for k2, v in row.items()
                                 if k2.startswith("t_")), flush=True)
    summary = summarize(runs, strategies, caches)
    print_table(summary)
    name = os.path.basename(path.rstrip("/")).replace(".safetensors", "")
    out = args.json or str(RAW / f"first_use-{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"checkpoint": path, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                   "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                   "cpus": os.cpu_count(), "reps": args.reps, "runs": runs,
                   "summary": summary}, f, indent=1)
    print(f"\nwrote {out} (load average before {load_before[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
