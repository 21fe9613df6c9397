"""Benchmark results: raw files, their kept summaries, and the generated results page.

Every benchmark writes its raw result (every run, every trace) under :data:`RAW`
(``bench/results/raw/``, ignored by git). :func:`update` reduces the raw files of each
:data:`SECTIONS` entry to one small summary, ``bench/results/<section>.json``: the
rendered table (medians, ratios) with the date, machine and load average of the run.
Only summaries are tracked, under :data:`BUDGET_TOTAL` bytes in all and
:data:`BUDGET_FILE` each (tests/test_repo_budget.py). :func:`render` turns the summaries
into ``docs/results.md``::

    python bench/results_page.py             # docs/results.md from the kept summaries
    python bench/results_page.py --update    # summaries from bench/results/raw/, then the page
    python bench/results_page.py --check     # exit 1 when docs/results.md is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchlib.paths import RAW, REPO, RESULTS


PAGE = REPO / "docs" / "results.md"
#: Tracked result JSON: bytes in all, and per file.
BUDGET_TOTAL = 200 * 1024
BUDGET_FILE = 32 * 1024


# -- the run's date, machine and load average, from whichever keys a suite wrote -----------

def _date(raw: dict, path: Path) -> str:
    for key in ("datetime", "date", "when"):
        if isinstance(raw.get(key), str):
            return raw[key][:10]
    for key in ("started", "finished"):
        if isinstance(raw.get(key), (int, float)):
            return time.strftime("%Y-%m-%d", time.gmtime(raw[key]))
    return time.strftime("%Y-%m-%d", time.gmtime(path.stat().st_mtime))


def _machine(raw: dict) -> str:
    info = raw.get("machine_info")
    if isinstance(info, dict):
        cpu = info.get("cpu", {})
        return f"{cpu.get('brand_raw', '?')}, {cpu.get('count', '?')} CPUs, {info.get('system', '')}"
    env = {**(raw.get("env") if isinstance(raw.get("env"), dict) else {}),
           **(raw.get("machine") if isinstance(raw.get("machine"), dict) else {})}
    if env:
        mem = env.get("mem_total_kib")
        parts = [env.get("cpu"), f"{env.get('cpus', '?')} CPUs",
                 f"{mem / 2**20:.0f} GiB" if mem else None,
                 (env.get("platform") or "").split("-with-")[0] or None,
                 f"mlx {env['mlx']}" if env.get("mlx") else None]
        return ", ".join(p for p in parts if p)
    if raw.get("cpus"):
        return f"{raw['cpus']} CPUs"
    return "not recorded"


def _loadavg(raw: dict) -> str:
    nested = [raw.get(k) for k in ("env", "machine_info") if isinstance(raw.get(k), dict)]
    for key in ("loadavg", "loadavg_before", "loadavg_start", "load_average"):
        v = raw.get(key)
        for d in nested:
            v = d.get(key) if v is None else v
        if isinstance(v, (list, tuple)) and len(v) == 3:
            return " / ".join(f"{x:.2f}" for x in v)
    return "not recorded"


# -- one renderer per kind of raw file --------------------------------------------------------

def _printed(fn: Callable[[], object]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn()
    return buf.getvalue().strip("\n")


def _compare(raw: dict, path: Path) -> tuple[str, str]:
    from pyloader.compare import genbench, harness

    if raw.get("workload") == "generate":
        return genbench.format_table(raw), "text"
    return harness.render_load(raw), "text"


def _streaming(raw: dict, path: Path) -> tuple[str, str]:
    from benchlib.rounds import benchmark_cases
    import stream_report
    cases = benchmark_cases(raw)
    return stream_report.render(cases) + "\n\n" + stream_report.targets(cases), "markdown"


def _experts(raw: dict, path: Path) -> tuple[str, str]:
    from benchlib.rounds import benchmark_cases
    import experts_report
    cases = benchmark_cases(raw)
    experts_report.add_bounds(cases)
    lines = (experts_report.table(cases) + [""] + experts_report.simulated(cases) + [""]
             + experts_report.targets(cases))
    return "\n".join(lines), "markdown"


def _kv(raw: dict, path: Path) -> tuple[str, str]:
    import kv_bench
    return kv_bench.table(kv_bench.summarize(raw)), "markdown"


def _heads(raw: dict, path: Path) -> tuple[str, str]:
    import heads_bench
    return heads_bench.render(raw, raw.get("command", "")), "markdown"


def _prediction(raw: dict, path: Path) -> tuple[str, str]:
    import prediction_bench
    return (prediction_bench.render(raw["label"], raw["summary"], raw["rounds"], raw["tokens"]),
            "markdown")


def _seed_scale(raw: dict, path: Path) -> tuple[str, str]:
    import seed_scale
    return seed_scale.report([path]), "markdown"


def _gguf_scale(raw: dict, path: Path) -> tuple[str, str]:
    import gguf_scale
    return gguf_scale.table(raw), "markdown"


def _stream_bound(raw: dict, path: Path) -> tuple[str, str]:
    import stream_bound
    return stream_bound.report(raw), "markdown"


def _distributed(raw: dict, path: Path) -> tuple[str, str]:
    import distributed_bench
    return distributed_bench.table(raw), "markdown"


def _llama_cpp(raw: dict, path: Path) -> tuple[str, str]:
    import llama_cpp
    return llama_cpp.report_table(raw), "markdown"


def _first_use(raw: dict, path: Path) -> tuple[str, str]:
    import first_use
    return _printed(lambda: first_use.print_table(raw["summary"])), "text"


def _pread_sweep(raw: dict, path: Path) -> tuple[str, str]:
    import pread_sweep
    return pread_sweep.table(raw), "text"


def _io_interference(raw: dict, path: Path) -> tuple[str, str]:
    lines = ["| decode beside | median s/token | rounds |", "|---|---|---|"]
    for name, median in raw["median"].items():
        lines.append(f"| {name} | {median:.3f} | {len(raw['s_per_token'][name])} |")
    return "\n".join(lines), "markdown"


def _compare_command(raw: dict) -> str:
    """The ``pyloader compare`` options a compare report records."""
    opts = raw.get("options", {})
    words = ["pyloader compare"] + (["--load-only"] if raw.get("workload") != "generate" else [])
    words += ["--strategies", ",".join(raw.get("strategies", []))]
    if opts.get("max_tokens"):
        words += ["--max-tokens", str(opts["max_tokens"])]
    if opts.get("allow_misaligned"):
        words.append("--allow-misaligned")
    models = ", ".join(c["label"] for c in raw.get("cases", []))
    return " ".join(words) + (f" (model: {models})" if models else "")


@dataclass(frozen=True)
class Section:
    """One table of the results page: a raw file (relative to :data:`RAW`), how to render
    it, and the guide that explains what it measures."""
    name: str
    title: str
    raw: str
    render: Callable[[dict, Path], tuple[str, str]]
    command: str
    guide: str


#: The results page, in order. ``command`` is what produced the raw file.
SECTIONS = [
    Section("compare-default", "Built-in model: load + generate, every loader", "compare-default/results.json",
            _compare, "pyloader compare", "compare.md"),
    Section("compare-ttft-overlap-2GB", "2 GB model: time to first token, eager and overlapped loads",
            "compare-ttft-overlap-2GB/results.json", _compare,
            "pyloader compare", "loading.md"),
    Section("compare-ttft-llama3.1-8b-q4-direct", "Llama 3.1 8B q4 shape: time to first token, direct I/O",
            "compare-ttft-llama3.1-8b-q4-direct/results.json", _compare,
            "pyloader compare",
            "loading.md"),
    Section("compare-1GiB-views", "1 GiB checkpoint: load only, misaligned tensors as views",
            "compare-1GiB-views/results.json", _compare,
            "pyloader compare", "benchmarks.md"),
    Section("compare-load-1GiB-2MiB", "1 GiB checkpoint: load only (aligned and MLX-written layouts)",
            "compare-load-1GiB-2MiB/results.json", _compare,
            "pyloader compare", "benchmarks.md"),
    Section("first-use-1GiB", "First use of every tensor after load", "first_use-llama-1GiB-f16.json",
            _first_use, "python bench/first_use.py", "loading.md"),
    Section("pread-sweep-bounds-1GiB", "Read bounds of the disk", "pread-sweep-bounds-1GiB.json",
            _pread_sweep, "python bench/pread_sweep.py", "benchmarks.md"),
    Section("streaming", "Layer streaming", "streaming.json", _streaming,
            "pytest bench/test_streaming_bench.py --benchmark-json=...", "streaming.md"),
    Section("stream-bound-1GB-f16", "Streaming against the read bound", "stream-bound-1GB-f16.json",
            _stream_bound, "python bench/stream_bound.py", "streaming.md"),
    Section("io-interference", "Streaming next to other disk readers", "io-interference.json",
            _io_interference, "python bench/io_interference.py", "streaming.md"),
    Section("experts", "Expert streaming", "experts.json", _experts,
            "pytest bench/test_experts_bench.py --benchmark-json=...", "expert-streaming.md"),
    Section("kv", "KV cache", "kv.json", _kv, "python bench/kv_bench.py sweep", "kv-cache.md"),
    Section("heads-smollm2-135m-4bit", "Swappable heads: built-in model",
            "heads-smollm2-135m-4bit-tail4.json", _heads,
            "python bench/heads_bench.py --model default --tail 4", "heads-and-repack.md"),
    Section("prediction-smollm2-135m-4bit-plan", "Residency planner: predicted vs measured",
            "prediction-smollm2-135m-4bit-plan-520MB.json", _prediction,
            "python bench/prediction_bench.py --model default --plan-ram 520MB", "memory-planning.md"),
    Section("seed-scale-llama3.1-8b-bf16", "Larger than memory: Llama 3.1 8B bf16",
            "seed-scale-llama3.1-8b-bf16.json", _seed_scale,
            "python bench/seed_scale.py --shape llama3.1-8b --format bf16", "seed-scale.md"),
    Section("seed-scale-llama3.1-8b-q4", "Larger than memory: Llama 3.1 8B q4",
            "seed-scale-llama3.1-8b-q4.json", _seed_scale,
            "python bench/seed_scale.py --shape llama3.1-8b --format q4", "seed-scale.md"),
    Section("seed-scale-qwen3.5-9b-bf16", "Larger than memory: Qwen3.5 9B bf16",
            "seed-scale-qwen3.5-9b-bf16.json", _seed_scale,
            "python bench/seed_scale.py --shape qwen3.5-9b --format bf16", "seed-scale.md"),
    Section("seed-scale-qwen3.5-9b-q4", "Larger than memory: Qwen3.5 9B q4",
            "seed-scale-qwen3.5-9b-q4.json", _seed_scale,
            "python bench/seed_scale.py --shape qwen3.5-9b --format q4", "seed-scale.md"),
    Section("seed-scale-qwen3.5-9b-q4-kernels",
            "Resident in 6 GB with pyloader's CPU kernels: Qwen3.5 9B q4",
            "seed-scale-qwen3.5-9b-q4-kernels.json", _seed_scale,
            "python bench/seed_scale.py --shape qwen3.5-9b --format q4 --limit 6GB "
            "--kernels auto", "seed-scale.md"),
    Section("seed-scale-qwen3.5-9b-bf16-kernels",
            "Streamed in 6 GB with pyloader's CPU kernels: Qwen3.5 9B bf16",
            "seed-scale-qwen3.5-9b-bf16-kernels.json", _seed_scale,
            "python bench/seed_scale.py --shape qwen3.5-9b --format bf16 --limit 6GB "
            "--kernels auto --residency ''", "seed-scale.md"),
    Section("distributed", "Distributed: pipeline over two ranks", "distributed.json", _distributed,
            "python bench/distributed_bench.py", "distributed.md"),
    Section("distributed-tensor", "Distributed: tensor parallel", "distributed-tensor.json",
            _distributed, "python bench/distributed_bench.py --suite tensor", "distributed.md"),
    Section("llama-cpp-tinyllama-1.1b", "CPU kernels against llama.cpp",
            "llama-cpp-tinyllama-1.1b.json", _llama_cpp, "python bench/llama_cpp.py",
            "kernels.md"),
    *(Section(f"llama-cpp-tinyllama-1.1b-{level}",
              f"CPU kernels against llama.cpp, level {level}",
              f"llama-cpp-tinyllama-1.1b-{level}.json", _llama_cpp,
              "python bench/llama_cpp.py --levels all", "kernels.md")
      for level in ("avx2", "avx512", "amx")),
    *(Section(f"llama-cpp-gguf-tinyllama-1.1b-{level}",
              f"GGUF files in place against llama.cpp on the same file, level {level}",
              f"llama-cpp-gguf-tinyllama-1.1b-{level}.json", _llama_cpp,
              "python bench/llama_cpp.py --gguf --levels all "
              "--formats q4,q8,f16,q4_k_m,q5_k_m,q6_k", "gguf.md")
      for level in ("avx2", "avx512", "amx")),
    Section("gguf-scale-llama3.1-8b-q4_k_m-auto", "GGUF in place: an 8B-class Q4_K_M file in 6 GB",
            "gguf-scale-llama3.1-8b-q4_k_m-auto.json", _gguf_scale,
            "python bench/gguf_scale.py --limit 6GB --tokens 16", "gguf.md"),
    Section("llama-cpp-llama3.1-8b", "CPU kernels against llama.cpp: an 8B shape",
            "llama-cpp-llama3.1-8b.json", _llama_cpp,
            "python bench/llama_cpp.py --shape llama3.1-8b --formats q4,q8,f16", "kernels.md"),
    Section("llama-cpp-llama3.1-8b-bf16",
            "CPU kernels against llama.cpp: the 8B shape in bfloat16",
            "llama-cpp-llama3.1-8b-bf16.json", _llama_cpp,
            "python bench/llama_cpp.py --shape llama3.1-8b --formats bf16 "
            "--out bench/results/raw/llama-cpp-llama3.1-8b-bf16.json", "kernels.md"),
]


def summarize(section: Section, raw_dir: Path = RAW) -> dict | None:
    """The kept summary of ``section`` from its raw file; None when there is none."""
    path = raw_dir / section.raw
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    text, fmt = section.render(raw, path)
    command = raw.get("command") or section.command
    if section.render is _compare:
        command = _compare_command(raw)
    return {"section": section.name, "title": section.title, "date": _date(raw, path),
            "machine": _machine(raw), "loadavg": _loadavg(raw), "command": command,
            "guide": section.guide, "format": fmt, "table": text}


def update(raw_dir: Path = RAW, out_dir: Path = RESULTS) -> list[str]:
    """Writes the summary of every section with a raw file; the names written."""
    written = []
    for section in SECTIONS:
        summary = summarize(section, raw_dir)
        if summary is None:
            continue
        (out_dir / f"{section.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
        written.append(section.name)
    return written


def render(results: Path = RESULTS) -> str:
    """``docs/results.md`` from the kept summaries in ``results``."""
    out = ["# Results", "",
           "<!-- generated by `python bench/results_page.py` from bench/results/*.json; "
           "do not edit by hand -->", "",
           "One table per run of the benchmarks in [benchmarks.md](benchmarks.md). Each names "
           "its date, "
           "machine and load average (1 / 5 / 15 minutes): compare ratios within a table, "
           "not times across tables.", ""]
    for section in SECTIONS:
        path = results / f"{section.name}.json"
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        out += [f"## {s['title']}", "",
                f"Date {s['date']} · machine: {s['machine']} · load average {s['loadavg']}  ",
                f"Command: `{s['command']}` · guide: [{s['guide']}]({s['guide']})", ""]
        out += ([s["table"]] if s["format"] == "markdown" else ["```text", s["table"], "```"])
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/results_page.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--update", action="store_true",
                   help="rebuild the summaries from bench/results/raw/ first")
    g.add_argument("--check", action="store_true",
                   help="exit 1 when docs/results.md differs from what the summaries give")
    p.add_argument("--out", type=Path, default=PAGE, help="the page (default docs/results.md)")
    args = p.parse_args(argv)
    if args.update:
        names = update()
        print(f"summaries: {', '.join(names) or 'none (no raw results)'}", file=sys.stderr)
    page = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"{args.out} is out of date: run python bench/results_page.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
