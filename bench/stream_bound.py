"""Streaming against its physical bound: a model at 0% resident inside a memory
cgroup smaller than it, each run cold and in a fresh process, against
``max(streamed bytes per token / read() bandwidth measured just before the run, compute
per token)``; and the same model streamed from a warm page cache (no limit) against its
all-resident speed.

    python bench/stream_bound.py                    # 1 GB f16 llama, 450 MB limit, 3 rounds
    python bench/stream_bound.py --rounds 5 --configs mmap-p1,pread-p1
    python bench/stream_bound.py --timeline DIR     # also a Chrome trace of every run
    python bench/stream_bound.py --report FILE.json # the Markdown table again
    python bench/stream_bound.py --before OLD/bin/python  # A/B against an earlier build

Per round, in this order (interleaved, so drifts of the disk or host hit every case
alike): the compute reference (plain mlx-lm, everything in memory, warm, no limit), each
constrained configuration (cold, in the cgroup, after two read() probes of the model's
file: the second is the bandwidth, see :func:`benchlib.scale.read_bandwidth`), then
the warm cases. Medians over rounds; tokens compared with the reference's.

Results: ``bench/results/raw/stream-bound-<size>-<dtype>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pyloader.compare.system import cache_dir
from pyloader.compare.system import loadavg
from pyloader.compare.system import parse_bytes
from benchlib.cgroup import unavailable_reason
from pyloader.compare.protocol import Child
from benchlib.paths import RAW
from benchlib.scale import add_bound, constrained_run, step_stats
from benchlib.synthetic import make_model
from pyloader.io.checkpoint import Checkpoint
from pyloader.io.pagecache import evict, warm
from benchlib.workloads import STREAM

RESULTS = RAW

#: Constrained (cold, in the cgroup) configurations: name -> stream workload arguments.
CONSTRAINED = {
    "mmap-p0": ["--strategy", "mmap", "--prefetch", "0"],
    "mmap-p1": ["--strategy", "mmap", "--prefetch", "1"],
    "mmap-p2": ["--strategy", "mmap", "--prefetch", "2"],
    "pread-p0": ["--strategy", "pread", "--prefetch", "0"],
    "pread-p1": ["--strategy", "pread", "--prefetch", "1"],
    "pread-p2": ["--strategy", "pread", "--prefetch", "2"],
    "mmap-sub-p1": ["--strategy", "mmap", "--granularity", "sublayer", "--prefetch", "1"],
    "mmap-sub-p2": ["--strategy", "mmap", "--granularity", "sublayer", "--prefetch", "2"],
    "pread-sub-p1": ["--strategy", "pread", "--granularity", "sublayer", "--prefetch", "1"],
    "pread-sub-p2": ["--strategy", "pread", "--granularity", "sublayer", "--prefetch", "2"],
    "mmap-auto": ["--strategy", "mmap", "--prefetch", "auto"],
    "pread-auto": ["--strategy", "pread", "--prefetch", "auto"],
    "mmap-sub-auto": ["--strategy", "mmap", "--granularity", "sublayer", "--prefetch", "auto"],
    "pread-sub-auto": ["--strategy", "pread", "--granularity", "sublayer", "--prefetch", "auto"],
}
#: Warm page cache, no limit: name -> (arguments, the all-resident case it is judged by).
WARM = {
    "resident-100": (["--strategy", "mmap", "--resident", "1.0"], None),
    "mmap-warm": (["--strategy", "mmap", "--keep-page-cache"], "resident-100"),
    "pread-warm": (["--strategy", "pread", "--keep-page-cache"], "resident-100"),
}
DEFAULT_CONFIGS = ",".join(CONSTRAINED)
#: Suffix of the rows run by ``--before``'s interpreter.
BEFORE = " (before)"


def _args(path: Path, tokens: int, prompt_tokens: int, extra: list[str]) -> list[str]:
    return [str(path), "--tokens", str(tokens - 1), "--prompt-tokens", str(prompt_tokens),
            "--resident", "0", *extra]


def _unconstrained(path: Path, ckpt: Checkpoint, args: list[str], label: str,
                   tokens: int, cold: bool, python: str | None = None) -> dict:
    if cold:
        evict(ckpt.files)
    else:
        warm(ckpt.files)
    out: dict = {"loadavg_before": loadavg()}
    with Child(STREAM, args, label=label, timeout=3600, python=python) as child:
        ready = child.start()
        out.update(step_stats(ready, child.go(), tokens), ran=True)
    return out


def run(path: Path, limit: int, pread_limit: int, configs: list[str], warm_cases: list[str],
        rounds: int, tokens: int, prompt_tokens: int, timeline: Path | None, say,
        before: str | None = None) -> dict:
    ckpt = Checkpoint(path)
    out: dict = {"model": {"path": str(path), "bytes": ckpt.total_nbytes,
                           "tensors": len(ckpt)},
                 "limit": limit, "pread_limit": pread_limit, "tokens": tokens, "prompt_tokens": prompt_tokens,
                 "rounds": [], "started": time.time(), "loadavg_start": loadavg()}
    for r in range(rounds):
        say(f"round {r + 1}/{rounds}")
        rnd: dict = {}
        ref = _unconstrained(path, ckpt, _args(path, tokens, prompt_tokens,
                                               ["--mode", "mlx-lm"]),
                             "reference (mlx-lm)", tokens, cold=False)
        rnd["reference"] = ref
        compute_s = ref["decode_s_per_token"]
        say(f"  reference {compute_s:.3f} s/token")
        for name, python in [(n + suffix, py) for n in configs
                             for suffix, py in [("", None)] + ([(BEFORE, before)] if before
                                                               else [])]:
            base = name.removesuffix(BEFORE)
            extra = list(CONSTRAINED[base])
            if timeline is not None and python is None:
                extra += ["--timeline", str(timeline / f"{name}-round{r + 1}.json")]
            row = constrained_run(ckpt, pread_limit if name.startswith("pread") else limit,
                                  _args(path, tokens, prompt_tokens, extra), name, tokens,
                                  3600, python=python)
            add_bound(row, compute_s)
            if row.get("ran"):
                row["tokens_identical"] = row["tokens"] == ref["tokens"]
                say(f"  {name}: {row['decode_s_per_token']:.3f} s/token, bound "
                    f"{row['bound_s']:.3f} (read {row['io_s']:.3f} at "
                    f"{row['bandwidth_bps'] / 1e9:.2f} GB/s), {row['vs_bound']:.2f}x, "
                    f"identical {row['tokens_identical']}")
            else:
                say(f"  {name}: did not run: {row.get('error')}")
            rnd[name] = row
        for name, python in [(n + suffix, py) for n in warm_cases
                             for suffix, py in [("", None)] + ([(BEFORE, before)] if before
                                                               else [])]:
            extra, _ = WARM[name.removesuffix(BEFORE)]
            row = _unconstrained(path, ckpt, _args(path, tokens, prompt_tokens, extra), name,
                                 tokens, cold=False, python=python)
            row["tokens_identical"] = row["tokens"] == ref["tokens"]
            say(f"  {name}: {row['decode_s_per_token']:.3f} s/token")
            rnd[name] = row
        out["rounds"].append(rnd)
    out["finished"] = time.time()
    out["loadavg_end"] = loadavg()
    return out


def summarize(res: dict) -> list[dict]:
    """Per case: medians over rounds of s/token, the bound, the ratio and the parts."""
    med = statistics.median
    names = [n for n in res["rounds"][0] if n != "reference"]
    rows = []
    ref = [r["reference"]["decode_s_per_token"] for r in res["rounds"]]
    rows.append({"case": "reference (mlx-lm, warm)", "s_per_token": med(ref)})
    for name in names:
        runs = [r[name] for r in res["rounds"] if r[name].get("ran")]
        if not runs:
            rows.append({"case": name, "error": res["rounds"][0][name].get("error")})
            continue
        depths = sorted({x["prefetch"] for x in runs if x.get("prefetch") is not None})
        label = (f"{name} (depth {'/'.join(map(str, depths))})"
                 if name.removesuffix(BEFORE).endswith("-auto") and depths else name)
        row = {"case": label, "s_per_token": med(x["decode_s_per_token"] for x in runs),
               "identical": all(x["tokens_identical"] for x in runs), "runs": len(runs)}
        if "bound_s" in runs[0]:
            row.update(
                bound_s=med(x["bound_s"] for x in runs), io_s=med(x["io_s"] for x in runs),
                bandwidth_gbps=med(x["bandwidth_bps"] for x in runs) / 1e9,
                vs_bound=med(x["vs_bound"] for x in runs),
                vs_bound_all=[round(x["vs_bound"], 3) for x in runs],
                peak_mb=med(x["cgroup"]["peak"] for x in runs) / 1e6,
                oom_kills=sum(x["cgroup"]["oom_kills"] for x in runs))
        passes = [x for x in runs if x.get("passes")]
        if passes:
            row["wait_s_per_pass"] = med(x["wait_s"] / x["passes"] for x in passes)
            row["compute_s_per_pass"] = med(x["compute_s"] / x["passes"] for x in passes)
        judge = WARM.get(name.removesuffix(BEFORE), (None, None))[1]
        if judge is not None:
            judge += BEFORE if name.endswith(BEFORE) else ""
            row["vs_resident_speed"] = med(
                r[judge]["decode_s_per_token"] / r[name]["decode_s_per_token"]
                for r in res["rounds"])
        rows.append(row)
    return rows


def report(res: dict) -> str:
    m = res["model"]
    lines = [
        (f"Model {m['path']} ({m['bytes'] / 1e9:.2f} GB), limit {res['limit'] / 1e6:.0f} MB, "
         f"{res['tokens']} tokens, {len(res['rounds'])} rounds; load average at start "
         f"{res['loadavg_start'][0]:.2f}, at end {res['loadavg_end'][0]:.2f}."), "",
        ("| case | s/token | bound s/token (read s at GB/s) | x bound (per round) "
         "| wait s/pass | compute s/pass | warm: x resident speed | peak MB | tokens |"),
        "|---|---:|---|---|---:|---:|---:|---:|:---:|"]
    for r in summarize(res):
        if "error" in r:
            lines.append(f"| {r['case']} | did not run: {r['error']} |||||||")
            continue
        nan = float("nan")
        cells = [
            r["case"], f"{r['s_per_token']:.3f}",
            f"{r['bound_s']:.3f} ({r['io_s']:.3f} at {r['bandwidth_gbps']:.2f})"
            if "bound_s" in r else "",
            f"**{r['vs_bound']:.2f}** ({', '.join(f'{v:.2f}' for v in r['vs_bound_all'])})"
            if "vs_bound" in r else "",
            f"{r.get('wait_s_per_pass', nan):.3f}", f"{r.get('compute_s_per_pass', nan):.3f}",
            f"{r['vs_resident_speed']:.2f}" if "vs_resident_speed" in r else "",
            f"{r['peak_mb']:.0f}" if "peak_mb" in r else "",
            "" if "identical" not in r else "identical" if r["identical"] else "**differ**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1e9", help="model bytes (synthetic llama)")
    ap.add_argument("--dtype", default="f16", choices=("f16", "bf16", "f32"))
    ap.add_argument("--limit", default="450MB", help="memory cgroup limit (mmap)")
    ap.add_argument("--pread-limit", default="600MB",
                    help="memory cgroup limit for pread (its units are anonymous memory: "
                         "they do not fit 450 MB beside the resident weights and reserve)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"constrained cases, of {', '.join(CONSTRAINED)}")
    ap.add_argument("--warm", default=",".join(WARM),
                    help=f"warm no-limit cases, of {', '.join(WARM)} ('' for none)")
    ap.add_argument("--timeline", type=Path, default=None, metavar="DIR",
                    help="write each constrained run's decode timeline into DIR")
    ap.add_argument("--before", default=None, metavar="PYTHON",
                    help="also run every case with this interpreter (an earlier build of "
                         "pyloader installed in it, with this pyloader.compare), interleaved: "
                         "rows marked (before)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, metavar="FILE.json",
                    help="print the table of an earlier result and exit")
    a = ap.parse_args(argv)
    if a.report is not None:
        print(report(json.loads(a.report.read_text())), end="")
        return 0
    reason = unavailable_reason()
    if reason is not None:
        print(f"needs a memory cgroup: {reason}", file=sys.stderr)
        return 2
    size = int(float(a.size))
    path = make_model(cache_dir(f"stream-model-{size}-{a.dtype}", create=False), size,
                      dtype=a.dtype)
    configs = [c for c in a.configs.split(",") if c]
    warm_cases = [c for c in a.warm.split(",") if c]
    for c in configs + warm_cases:
        if c not in CONSTRAINED and c not in WARM:
            ap.error(f"unknown case {c!r}")
    if a.timeline is not None:
        a.timeline.mkdir(parents=True, exist_ok=True)
    res = run(path, parse_bytes(a.limit), parse_bytes(a.pread_limit), configs, warm_cases, a.rounds, a.tokens,
              a.prompt_tokens, a.timeline, lambda s: print(s, flush=True), before=a.before)
    res["argv"] = sys.argv[1:] if argv is None else list(argv)
    res["before"] = a.before
    out = a.out or RESULTS / f"stream-bound-{size / 1e9:g}GB-{a.dtype}.json"
    out.write_text(json.dumps(res, indent=1))
    text = report(res)
    out.with_suffix(".md").write_text(text)
    print(text, end="")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
