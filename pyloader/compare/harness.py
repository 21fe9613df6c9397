"""The measuring loop of ``pyloader compare`` and the load benchmark. See docs/compare.md."""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import mlx.core as mx

from .._util.host import host_memory
from .._version import __version__
from ..errors import MeasureError
from ..io.checkpoint import Checkpoint
from ..io.gguf_header import is_gguf
from ..io.gguf_source import GGUFSource
from ..io.pagecache import CACHE_STATES, page_cache_fraction, prepare_cache
from .protocol import Child
from .workloads import load as load_workload

STRATEGIES = load_workload.STRATEGIES
CACHES = CACHE_STATES

# (key, label, display scale): the metrics summarized per case.
METRICS = [
    ("t_dict", "time to dict", 1.0),
    ("t_read_all", "time to read all", 1.0),
    ("anon_delta", "anon memory added", 2**-20),
    ("rss_anon", "RssAnon", 2**-20),
    ("rss_file", "RssFile", 2**-20),
    ("peak_rss", "peak RSS", 2**-20),
    ("mx_peak", "mx peak", 2**-20),
    ("mx_active", "mx active", 2**-20),
    ("zero_copy_fraction", "zero-copy", 1.0),
    ("copied_bytes", "copied", 2**-20),
]


@dataclass(frozen=True)
class LoadArgs:
    """The load workload's settings (its command-line flags)."""

    stop_after: str = "read_all"
    threads: int | None = None
    chunk_bytes: int | None = None
    allow_misaligned: bool = False
    backend: str | None = None

    def flags(self, strategy: str) -> list[str]:
        args = ["--strategy", strategy, "--stop-after", self.stop_after]
        if self.threads:
            args += ["--threads", str(self.threads)]
        if self.chunk_bytes:
            args += ["--chunk-bytes", str(self.chunk_bytes)]
        if self.allow_misaligned:
            args += ["--allow-misaligned"]
        if self.backend and strategy == "pread":
            args += ["--backend", self.backend]
        return args


def measure_once(path: str, strategy: str, cache: str, *, files: list[str] | None = None,
                 **load_args) -> dict:
    """One run in a fresh child (``load_args``: :class:`LoadArgs`' fields); the result
    gains ``page_cache_before`` and ``t_parent``."""
    path = os.path.abspath(path)
    args = [path, *LoadArgs(**load_args).flags(strategy)]
    with Child("load", args, label=f"{strategy} on {path}") as child:
        ready = child.start()
        prepare_cache(cache, files or ready["files"])
        before = page_cache_fraction(path)
        t0 = time.perf_counter()
        result = child.go()
        result["t_parent"] = time.perf_counter() - t0
        result["page_cache_before"] = before
        return result


def flatten(result: dict) -> dict:
    """One run's metrics as a flat dict (memory after the last phase run)."""
    last = result.get("read_all") or result["dict"]
    row = {
        "t_dict": result["t_dict"],
        "t_read_all": result.get("t_read_all"),
        "t_parent": result.get("t_parent"),
        "page_cache_before": result.get("page_cache_before"),
        "bytes": result["bytes"],
        "tensors": result["tensors"],
        **{k: result["stats"][k] for k in ("zero_copy_fraction", "copied_bytes",
                                           "zero_copy_verified")},
        "rss_anon_ready": result["rss_anon_ready"],
        **{k: last[k] for k in ("peak_rss", "rss", "rss_anon", "rss_file", "anon_delta",
                                "mx_peak", "mx_active")},
    }
    for phase in ("dict", "read_all"):
        usage = result.get(f"usage_{phase}")
        if usage:
            row.update({f"{phase}_{k}": v for k, v in usage.items()})
    return row


@dataclass
class Case:
    """A checkpoint under test."""

    label: str
    path: str
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    tensors: int = 0
    aligned_bytes: int = 0


def describe_case(label: str, path: str) -> Case:
    """A :class:`Case` for the checkpoint at ``path`` (its headers are read and checked; a
    GGUF file's tensors as it is read in place)."""
    ckpt = GGUFSource.open(path).checkpoint if is_gguf(path) else Checkpoint(path)
    a = ckpt.alignment_summary()
    return Case(label, os.fspath(path), list(ckpt.files), a["bytes"], a["tensors"],
                a["aligned_bytes"])


def summarize(rows: list[dict], metrics: list[tuple] | None = None, baseline: str = "mlx",
              order: tuple[str, ...] | list[str] | None = None) -> list[dict]:
    """Median, min, max and baseline ratios per (checkpoint, cache, strategy)."""
    metrics = METRICS if metrics is None else metrics
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "error" in r or r.get("excluded"):
            continue
        groups.setdefault((r["checkpoint"], r["cache"], r["strategy"]), []).append(r)
    out = []
    for (ckpt, cache, strategy), rs in groups.items():
        s = {"checkpoint": ckpt, "cache": cache, "strategy": strategy, "runs": len(rs),
             "bytes": rs[0]["bytes"]}
        for key, _, _ in metrics:
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                s[key] = statistics.median(vals)
                s[f"{key}_min"], s[f"{key}_max"] = min(vals), max(vals)
        out.append(s)
    base = {(s["checkpoint"], s["cache"]): s for s in out if s["strategy"] == baseline}
    for s in out:
        b = base.get((s["checkpoint"], s["cache"]))
        if not b:
            continue
        for key, _, _ in metrics:
            if key in s and b.get(key):
                s[f"{key}_x_{baseline}"] = s[key] / b[key]
    rank = {n: i for i, n in enumerate(STRATEGIES if order is None else order)}
    out.sort(key=lambda s: (s["checkpoint"], CACHES.index(s["cache"]) if s["cache"] in CACHES
                            else 9, rank.get(s["strategy"], 99)))
    return out


def check_targets(summary: list[dict]) -> list[dict]:
    """Evaluate the load targets: ``value`` (median ratio), ``best`` and whether met."""
    idx = {(s["checkpoint"], s["cache"], s["strategy"]): s for s in summary}
    # (name, caches, numerator, denominator, metric, op, goal, unit): a ratio of strategies.
    specs = [
        ("mmap time-to-dict speed-up vs mx.load", CACHES, "mlx", "mmap", "t_dict", ">=", 20.0,
         "x"),
        ("mmap time-to-read-all / mx.load's", ("warm",), "mmap", "mlx", "t_read_all", "<=", 1.0,
         "x"),
        ("pread throughput / mx.load's", CACHES, "mlx", "pread", "t_dict", ">=", 1.0, "x"),
        ("mmap anonymous memory / mx.load's", CACHES, "mmap", "mlx", "anon_delta", "<=", 0.05,
         "%"),
    ]
    out = []
    for ckpt in sorted({s["checkpoint"] for s in summary}):
        for name, caches, num, den, key, op, goal, unit in specs:
            for cache in caches:
                a, b = idx.get((ckpt, cache, num)), idx.get((ckpt, cache, den))
                if not a or not b or key not in a or not b.get(key):
                    continue
                value = max(a[key], 0) / b[key]
                best = (a[f"{key}_min"] / b[f"{key}_min"]
                        if key.startswith("t_") and b.get(f"{key}_min") else None)
                out.append({"checkpoint": ckpt, "cache": cache, "target": name,
                            "value": value, "best": best, "op": op, "goal": goal,
                            "unit": unit, "met": value >= goal if op == ">=" else value <= goal})
    return out


def _fmt_ratio(v: float, unit: str) -> str:
    return f"{v * 100:.1f}%" if unit == "%" else f"{v:.2f}x"


def format_targets(targets: list[dict]) -> str:
    """The target checks of :func:`check_targets` as text, one line each."""
    return "\n".join(
        f"  {'MET ' if t['met'] else 'MISS'}  {t['checkpoint']:<12} {t['cache']:<5} "
        f"{t['target']:<38} {_fmt_ratio(t['value'], t['unit']):>9} "
        f"(target {t['op']} {_fmt_ratio(t['goal'], t['unit'])}"
        + (f"; best runs {_fmt_ratio(t['best'], t['unit'])})" if t.get("best") else ")")
        for t in targets)


def _fmt_spread(s: dict, key: str, digits: int, scale: float = 1.0) -> str:
    if key not in s:
        return "-"
    return (f"{s[key] * scale:.{digits}f} ({s[key + '_min'] * scale:.{digits}f}"
            f"-{s[key + '_max'] * scale:.{digits}f})")


def _mib(value: float | None, digits: int) -> str:
    """Bytes as MiB text; "-" for a figure this platform did not report (None)."""
    return "-" if value is None else f"{value / 2**20:.{digits}f}"


def format_table(summary: list[dict], cases: dict[str, Case] | None = None) -> str:
    """Plain-text table, one block per checkpoint and cache state."""
    cols = [("strategy", 11), ("t_dict s (min-max)", 24), ("x mlx", 7),
            ("t_read_all s (min-max)", 24), ("x mlx", 7), ("anon+ MiB", 10), ("x mlx", 7),
            ("peak RSS MiB", 12), ("RssFile MiB", 11), ("zero-copy", 9)]
    lines = []
    for ckpt, cache in dict.fromkeys((s["checkpoint"], s["cache"]) for s in summary):
        block = [s for s in summary if (s["checkpoint"], s["cache"]) == (ckpt, cache)]
        head = f"{ckpt} [{cache}]"
        c = (cases or {}).get(ckpt)
        if c:
            head += (f"  {os.path.basename(c.path)}: {c.bytes / 2**30:.2f} GiB, "
                     f"{c.tensors} tensors, {100 * c.aligned_bytes / max(c.bytes, 1):.0f}% "
                     "of bytes aligned")
        head += f", {block[0]['runs']} runs"
        lines += ["", head, "  ".join(f"{n:<{w}}" for n, w in cols)]
        for s in block:
            def x(k, s=s):
                return f"{s[k + '_x_mlx']:.3f}" if k + "_x_mlx" in s else "-"

            cells = [s["strategy"], _fmt_spread(s, "t_dict", 4), x("t_dict"),
                     _fmt_spread(s, "t_read_all", 4), x("t_read_all"),
                     _mib(s.get("anon_delta"), 1), x("anon_delta"),
                     *(_mib(s.get(k), 0) for k in ("peak_rss", "rss_file")),
                     f"{100 * s.get('zero_copy_fraction', 0):.0f}%"]
            lines.append("  ".join(f"{v:<{w}}" for v, (_, w) in zip(cells, cols)))
    return "\n".join(lines).lstrip("\n")


def environment() -> dict:
    """Versions, platform, CPU count, memory and load average, for the report."""
    env = {"python": sys.version.split()[0], "mlx": mx.__version__, "pyloader": __version__,
           "platform": platform.platform(), "cpus": os.cpu_count()}
    total = host_memory()[0]
    if total is not None:
        env["mem_total_kib"] = total // 1024
    if hasattr(os, "getloadavg"):
        env["loadavg"] = list(os.getloadavg())
    with contextlib.suppress(ImportError):
        import safetensors

        env["safetensors"] = safetensors.__version__
    return env


def _load_progress(row: dict) -> str:
    """One line of progress for a finished load run."""
    return (f"dict {row['t_dict']:.4f} s, read all {row['t_read_all']:.4f} s, anon +"
            f"{_mib(row['anon_delta'], 0)} MiB, cached {100 * row['page_cache_before']:.0f}%")


def render_load(report: dict) -> str:
    """A load benchmark report as text: the table and the target check."""
    text = format_table(report["summary"], {c["label"]: Case(**c) for c in report["cases"]})
    if report.get("options"):
        text = f"options: {report['options']}\n\n" + text
    errors = [r for r in report["runs"] if "error" in r]
    if errors:
        text += f"\n\n{len(errors)} run(s) failed; first error:\n{errors[0]['error']}"
    if report["targets"]:
        text += ("\n\nLoad targets (ratio of medians within this invocation; "
                 "'best runs' compares each side's fastest run):\n")
        text += format_targets(report["targets"])
    return text


@dataclass
class Workload:
    """What :func:`run_compare` measures and how it reports it: ``measure`` runs one
    case in a fresh child, ``metrics`` as ``(key, label, scale)``, ratios against
    ``baseline``, and the ``flatten``, ``progress``, ``finish``, ``targets`` and ``render``
    callbacks."""

    name: str = "load"
    measure: Callable[..., dict] = measure_once
    metrics: list = field(default_factory=lambda: list(METRICS))
    baseline: str = "mlx"
    order: tuple = STRATEGIES
    flatten: Callable[[dict], dict] = flatten
    progress: Callable[[dict], str] = _load_progress
    finish: Callable[[list[dict], dict], None] | None = None
    targets: Callable[[list[dict]], list[dict]] = check_targets
    render: Callable[[dict], str] = render_load


LOAD = Workload()


def run_compare(cases: list[Case], strategies: list[str], caches: list[str], runs: int,
                out_dir: str | None, *, log: TextIO | None | str = "stderr",
                options: dict | None = None, workload: Workload = LOAD) -> dict:
    """Run every case, cache, run and strategy; write the results and return the report."""
    options = options or {}
    if log == "stderr":  # looked up now: sys.stderr may have been replaced since import
        log = sys.stderr
    rows: list[dict] = []
    total = len(cases) * len(caches) * runs * len(strategies)
    done = 0
    t_start = time.monotonic()
    for case, cache, run in itertools.product(cases, caches, range(runs)):
        k = run % len(strategies)
        for strategy in strategies[k:] + strategies[:k]:
            done += 1
            if log:
                print(f"[{done}/{total}] {case.label} {cache} run {run + 1}/{runs} {strategy} ...",
                      end="", file=log, flush=True)
            row = {"checkpoint": case.label, "path": case.path, "cache": cache, "run": run,
                   "strategy": strategy}
            try:
                row.update(workload.flatten(workload.measure(case.path, strategy, cache,
                                                             files=case.files, **options)))
                if log:
                    print(f" {workload.progress(row)} [{time.monotonic() - t_start:.0f} s]",
                          file=log, flush=True)
            except MeasureError as exc:
                row["error"] = str(exc)
                if log:
                    print(f" FAILED: {str(exc).splitlines()[0]}", file=log, flush=True)
            rows.append(row)
    report = {
        "env": environment(),
        "workload": workload.name,
        "baseline": workload.baseline,
        "strategies": strategies,
        "options": options,
        "caches": caches,
        "runs_per_case": runs,
        "cases": [vars(c) for c in cases],
        "runs": rows,
    }
    if workload.finish:
        workload.finish(rows, report)
    report["summary"] = summarize(rows, workload.metrics, workload.baseline, workload.order)
    report["targets"] = workload.targets(report["summary"])
    if out_dir:
        write_report(report, out_dir, workload.render)
    return report


def write_report(report: dict, out_dir: str, render: Callable[[dict], str]) -> None:
    """results.json, runs.csv, summary.csv and table.txt (``render(report)``) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    for name, rows in (("runs.csv", report["runs"]), ("summary.csv", report["summary"])):
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(os.path.join(out_dir, name), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(render(report) + "\n")
