"""The seeds' headline on this machine: an 8B-class model inside a fraction of its size.

Writes (once, cached under ``~/.cache/pyloader/scale``) a sharded checkpoint of a real
model's shape (:mod:`benchlib.synthetic.shapes`: ``llama3.1-8b`` or ``qwen3.5-9b``, ``bf16``
or ``q4``), then runs :func:`benchlib.scale.run_scale`: plain mlx-lm without a limit
(the reference tokens and the compute per token), ``load_planned(path, "auto")`` inside a
memory cgroup of ``--limit``, and the residency rows inside the same limit, each cold and
in a fresh process. Not part of CI (a run takes 10-30 minutes); the test suite runs the
same path on the shapes' tiny variants (tests/test_scale.py).

    python bench/seed_scale.py --shape llama3.1-8b --format bf16 --limit 6GB
    python bench/seed_scale.py --shape qwen3.5-9b --format q4 --limit 2GB
    python bench/seed_scale.py --shape qwen3.5-9b --format q4 --limit 6GB --kernels auto
    python bench/seed_scale.py --report     # the table of every result file
    python bench/seed_scale.py --summary    # the planned runs only
    python bench/seed_scale.py --repredict  # predictions from a quiet machine's calibration

``--kernels auto`` runs every process (the reference too) with pyloader's CPU kernels
instead of MLX's ops. Results: ``bench/results/raw/seed-scale-<shape>-<format>.json``
(``...-kernels.json`` with ``--kernels auto``); ``--report`` prints the
Markdown table (the results page shows it: bench/results_page.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pyloader import residency
from pyloader.compare.system import cache_dir
from pyloader.compare.system import loadavg
from pyloader.compare.system import parse_bytes
from benchlib.paths import RAW
from benchlib.scale import run_scale
from benchlib.synthetic.shapes import FORMATS, SHAPES, make_sharded_model
from pyloader.kernels import KERNELS

RESULTS = RAW
#: A result whose 1-minute load average before the runs exceeded this (on 2 CPUs: more
#: than the benchmark's own process) is marked busy in the table: not a quiet figure.
BUSY_LOAD = 2.0


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _read_path(r: dict) -> str:
    """The planned run's read path: the strategy given, or what ``auto`` chose."""
    strategy = r.get("strategy", "mmap")
    plan = (r.get("planned") or {}).get("plan")
    if strategy == "auto" and plan:
        # Result files before the child recorded its choice: every layer here is larger
        # than planner.PREAD_MIN_LAYER_BYTES, so a streamed one meant pread.
        chosen = plan.get("strategy") or (
            "pread" if len(plan["resident_layers"]) < plan["layers"] else "mmap")
        return f"auto: {chosen}"
    return strategy


def _name(r: dict) -> str:
    """A result's row name: shape, format, read path, date, its label (what set the run
    apart, e.g. an older build) and a busy machine's load."""
    name = (f"{r['shape']} {r['format']}, {_read_path(r)}, "
            f"{'pyloader kernels, ' if r.get('kernels') == 'auto' else ''}"
            f"{time.strftime('%Y-%m-%d', time.gmtime(r['started']))}")
    if r.get("label"):
        name += f", {r['label']}"
    if (r.get("loadavg_before") or [0])[0] > BUSY_LOAD:
        name += f" (busy: load {r['loadavg_before'][0]:.1f})"
    return name


def report(paths: list[Path]) -> str:
    """The Markdown table of the given result files."""
    lines = [
        "| model | weights | limit | run | resident | load s | s/token (tok/s) | bound s/token "
        "(read, compute) | vs bound | peak cgroup GB | planner predicted s/token (error) "
        "| tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        r = json.loads(p.read_text())
        name = _name(r)
        size = f"{_gb(r['model']['bytes'])} GB, {r['model']['shards']} shards"
        ref = r["reference"]
        lines.append(f"| {name} | {size} | none | mlx-lm | 100% | {ref['load_s']:.1f} | "
                     f"{ref['decode_s_per_token']:.2f} ({1 / ref['decode_s_per_token']:.3f}) "
                     "| - | - | - | - | reference |")
        runs = [("planned (auto)", r["planned"])] + [
            (f"resident {row['resident']:.0%}", row) for row in r["rows"]]
        for label, row in runs:
            limit = f"{_gb(r['limit'])} GB"
            if not row.get("ran"):
                why = "refused up front (MemoryError)" if row.get("refused") else "failed"
                lines.append(f"| {name} | {size} | {limit} | {label} | | | | | | "
                             f"{_gb(row['cgroup']['peak'])} | | {why} |")
                continue
            if "plan" in row:
                p_ = row["plan"]
                resident = f"{len(p_['resident_layers'])}/{p_['layers']} layers"
            else:
                resident = f"{row['resident']:.0%}"
            if (row.get("resident_bytes") or 0) > r["limit"]:  # ResidencyWarning: thrashes
                resident += f" ({_gb(row['resident_bytes'])} GB mapped > limit)"
            pred = ""
            if "predicted_s_per_token" in row:
                pred = f"{row['predicted_s_per_token']:.2f} ({row['prediction_error']:+.0%})"
            lines.append(
                f"| {name} | {size} | {limit} | {label} | {resident} | {row['load_s']:.1f} | "
                f"{row['decode_s_per_token']:.2f} ({1 / row['decode_s_per_token']:.3f}) | "
                f"{row['bound_s']:.2f} "
                f"({row['io_s']:.2f}, {ref['decode_s_per_token']:.2f}) | "
                f"{row['vs_bound']:.2f}x | {_gb(row['cgroup']['peak'])} | {pred} | "
                f"{'identical' if row['tokens_identical'] else 'DIFFERENT'} |")
    return "\n".join(lines)


def summary(paths: list[Path]) -> str:
    """One row per result: the planned run against the unconstrained reference."""
    lines = ["| model | weights | limit | planner's resident set | load s | s/token "
             "(mlx-lm, no limit) | bound s/token | peak cgroup GB | tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        r = json.loads(p.read_text())
        pl, ref = r["planned"], r["reference"]
        name = _name(r)
        if not pl.get("ran"):
            lines.append(f"| {name} | | {_gb(r['limit'])} GB | did not run: {pl.get('error')} "
                         "| | | | | |")
            continue
        lines.append(
            f"| {name} | {_gb(r['model']['bytes'])} GB, {r['model']['shards']} shards | "
            f"{_gb(r['limit'])} GB | {len(pl['plan']['resident_layers'])}/"
            f"{pl['plan']['layers']} layers | {pl['load_s']:.1f} | "
            f"{pl['decode_s_per_token']:.2f} ({ref['decode_s_per_token']:.2f}) | "
            f"{pl['bound_s']:.2f} ({pl['vs_bound']:.2f}x) | {_gb(pl['cgroup']['peak'])} | "
            f"{'identical' if pl['tokens_identical'] else 'DIFFERENT'} |")
    return "\n".join(lines)


def _predict(planned: dict, budget, cal, note: str) -> None:
    """The planner's prediction for the planned run's resident set from ``cal``."""
    resident = planned["plan"]["resident_layers"]
    strategy = planned["plan"].get("strategy") or residency.read_strategy(
        budget.layer_bytes, set(resident))
    pred = residency.predict(budget, resident, cal, strategy=strategy)
    planned["predicted_s_per_token"] = pred["decode_s_per_token"]
    planned["prediction_error"] = pred["decode_s_per_token"] / planned["decode_s_per_token"] - 1
    planned["prediction_note"] = note


def repredict(paths: list[Path]) -> None:
    """Re-predicts each result's planned run from the machine calibration as it is now
    (measured, and cached, if absent; a busy machine's calibration is never cached, so
    run this on a quiet one): for results whose own calibration was contended."""
    for p in paths:
        r = json.loads(p.read_text())
        planned = r["planned"]
        if not planned.get("ran"):
            continue
        path = r["model"]["path"]
        budget = residency.model_budget(path)
        # The kernels the runs computed with (results from before the option: MLX's).
        cal = residency.calibrate_machine(
            residency.format_of(budget, path, r.get("kernels", "mlx")))
        why = cal.detail.get("contended")
        _predict(planned, budget, cal, "machine calibration measured "
                 + time.strftime("%Y-%m-%d %H:%M", time.gmtime(cal.measured_at))
                 + (f" (contended: {why})" if why else " on a quiet machine (cached)"))
        r["calibration"] = cal.to_dict()
        p.write_text(json.dumps(r, indent=1))
        print(f"{p.name}: predicted {planned['predicted_s_per_token']:.2f} s/token, "
              f"measured {planned['decode_s_per_token']:.2f} "
              f"({planned['prediction_error']:+.0%}); {planned['prediction_note']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3.1-8b")
    ap.add_argument("--format", choices=list(FORMATS), default="bf16")
    ap.add_argument("--limit", type=parse_bytes, default=None,
                    help="memory cgroup limit (default: 6GB for bf16, 2GB for q4)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens of the reference "
                    "and the planned run")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--residency", default="0,0.25,0.5,0.75,1",
                    help="resident fractions of the residency rows")
    ap.add_argument("--row-tokens", type=int, default=4, help="tokens of each residency row")
    ap.add_argument("--strategy", choices=("auto", "mmap", "pread"), default="auto",
                    help="read path of the planned run and the rows (auto: load_planned's "
                         "choice; rows: the same rule, planner.read_strategy: pread when a "
                         "streamed layer has 64 MiB or more)")
    ap.add_argument("--kernels", choices=KERNELS, default="mlx",
                    help="what every run computes with, the reference included: MLX's ops "
                         "(mlx, plain mlx-lm) or pyloader's CPU kernels (auto; the result "
                         "file's name ends in -kernels; docs/kernels.md)")
    ap.add_argument("--tiny", action="store_true", help="the shape's tiny variant")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where the model is written (default ~/.cache/pyloader/scale)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--timeline", type=Path, default=None, metavar="FILE.json",
                    help="write the planned run's decode timeline (pyloader.trace) there; "
                         "its summary goes into the result file")
    ap.add_argument("--report", action="store_true",
                    help="print the table of bench/results/raw/seed-scale-*.json and exit")
    ap.add_argument("--summary", action="store_true",
                    help="print the planned runs' table and exit")
    ap.add_argument("--repredict", action="store_true",
                    help="recompute the planned runs' predictions in bench/results from "
                         "the machine calibration now (run on a quiet machine) and exit")
    args = ap.parse_args(argv)
    if args.repredict:
        repredict(sorted(RESULTS.glob("seed-scale-*.json")))
        return 0
    if args.report or args.summary:
        files = sorted(RESULTS.glob("seed-scale-*.json"))
        print(report(files) if args.report else summary(files))
        return 0
    limit = args.limit or (6_000_000_000 if args.format == "bf16" else 2_000_000_000)
    tag = f"{args.shape}-{args.format}" + ("-tiny" if args.tiny else "")
    model_dir = args.model_dir or cache_dir("scale") / tag
    if args.kernels == "auto":
        tag += "-kernels"
    print(f"writing (or reusing) {model_dir} ...", file=sys.stderr, flush=True)
    path = make_sharded_model(model_dir, args.shape, args.format, tiny=args.tiny)
    # The planner's prediction comes from the machine calibration of this model's
    # format (what a user gets first); measured once and cached, before the runs.
    budget = residency.model_budget(path)
    cal = residency.calibrate_machine(residency.format_of(budget, path, args.kernels))
    before = loadavg()
    print(f"load average before: {before}", file=sys.stderr, flush=True)
    result = run_scale(path, limit, tokens=args.tokens, prompt_tokens=args.prompt_tokens,
                       residency=[float(x) for x in args.residency.split(",") if x],
                       row_tokens=args.row_tokens, strategy=args.strategy,
                       timeline=args.timeline, kernels=args.kernels,
                       log=lambda s: print(s, file=sys.stderr, flush=True))
    planned = result["planned"]
    if planned.get("ran") and "predicted_s_per_token" not in planned:
        # load_planned predicts only from a cached calibration, and one measured on a busy
        # machine is never cached: predict from this run's, saying why it was not cached.
        _predict(planned, budget, cal, "machine calibration measured before this run, "
                 f"not cached: {cal.detail.get('contended')}")
    result.update(calibration=cal.to_dict(), shape=args.shape, format=args.format, tiny=args.tiny,
                  loadavg_before=before, loadavg_after=loadavg(), cpus=os.cpu_count(),
                  command=" ".join(["python", "bench/seed_scale.py", *(argv or sys.argv[1:])]))
    out = args.out or RESULTS / f"seed-scale-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(report([out]))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
