"""Head hot-swap benchmark: full reload vs cold swap vs warm swap.

A bundle is built from a base model and two variants made by seeded noise on
the tail (``benchlib.synthetic.make_variant``): heads ``base``,
``chat`` (variant 1) and ``code`` (variant 2). The app is "running variant 1
and switches to variant 2". Each scenario runs in a fresh process that first
reaches that steady state (model loaded, one token generated), then times the
switch alone:

* ``reload-mlx``: ``del model`` and ``mlx_lm.utils.load_model(variant 2)``
  (what ``mlx_lm.load`` does for the weights, evaluated; the tokenizer is not
  reloaded in any scenario): what apps do today; ``-cold`` with variant 2's file evicted
  from the page cache, ``-warm`` with it cached.
* ``reload-pyloader``: the same with ``load_model(variant 2)``.
* ``swap-cold``: ``model.swap_head("code")`` with the head file evicted.
* ``swap-warm``: the same after ``model.preload_heads(["code"], wait=True)``.

Memory deltas across the switch (in the same process): RSS after − before,
peak RSS (``VmHWM`` reset through ``/proc/self/clear_refs`` just before) −
before, ``RssAnon`` after − before and how far MLX's allocated memory rose
above its level before (``mx.get_peak_memory()`` after ``reset_peak_memory``,
minus the active memory before, floored at 0). A figure the platform does not report
is None (n/a in the table): the peak RSS without ``/proc`` (macOS, ``PYLOADER_NO_PROC``),
RSS and ``RssAnon`` without ``/proc`` or macOS's ``task_info``
(``pyloader.compare.system``). A reload frees the old model
first (``del model``), the leanest reload an app can do; MLX then reuses the
freed buffers from its cache, so its RSS changes little. After the
switch 8 greedy tokens are generated; every scenario must give the tokens of
variant 2, or the run fails.

Targets, on medians within one run: warm swap ≤ 5% of the full
reload (warm page cache); cold swap ≤ 1.3 × (head bytes / model bytes) × the
cold full reload. Both against ``reload-mlx``.

Commands:
    python bench/heads_bench.py --model default --tail 4 --rounds 5
    python bench/heads_bench.py --model synthetic:1GiB --tail 2 --rounds 5
Results: bench/results/raw/heads-<label>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pyloader.compare.harness import environment
from benchlib.paths import RAW

SCENARIOS = ("reload-mlx-cold", "reload-mlx-warm", "reload-pyloader-warm", "swap-cold",
             "swap-warm")
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]
MiB = 2**20


def greedy(model, n: int = 8) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


# ----------------------------------------------------------------------------
# Child: one scenario


def child(args) -> None:
    import gc

    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_load_model

    from pyloader import io as pio
    from pyloader.loading import load_model
    from pyloader.compare.system import process_memory
    from pyloader.compare.system import reset_peak_rss

    def mlx_load(path):  # weights evaluated (lazy=False); no tokenizer, both sides
        return mlx_load_model(Path(path))

    s = args.scenario
    if s.startswith("reload"):
        model, _ = mlx_load(args.variant1)
    else:
        model, _ = load_model(args.bundle, head="chat", tokenizer=False)
        if s == "swap-warm":
            model.preload_heads(["code"], wait=True)
    greedy(model, 1)
    if s.endswith("cold"):
        victim = (Path(args.bundle) / "heads" / "code.safetensors" if s == "swap-cold"
                  else Path(args.variant2) / "model.safetensors")
        pio.evict_file(victim)
    elif s.startswith("reload"):
        Path(args.variant2, "model.safetensors").read_bytes()  # warm page cache
    gc.collect()
    peak_reset = reset_peak_rss()  # VmHWM := RSS; Linux with /proc only
    mx.reset_peak_memory()
    before = process_memory()
    active0 = mx.get_active_memory()
    swap = None
    t0 = time.perf_counter()
    if s.startswith("reload-mlx"):
        del model
        gc.collect()
        model, _ = mlx_load(args.variant2)  # evaluates every parameter
    elif s.startswith("reload-pyloader"):
        del model
        gc.collect()
        model, _ = load_model(args.variant2, tokenizer=False)
    else:
        swap = model.swap_head("code")
    seconds = time.perf_counter() - t0
    after = process_memory()
    result = {
        "scenario": s,
        "seconds": seconds,
        "rss_delta": difference(after.rss, before.rss),
        # Without a reset the peak is the process's lifetime peak: not the switch's.
        "peak_rss_delta": difference(after.peak_rss, before.rss) if peak_reset else None,
        "anon_delta": difference(after.rss_anon, before.rss_anon),
        # MLX-allocated memory above its level before the switch (views of
        # file mappings are not MLX allocations; 0 = never rose above it).
        "mlx_peak_delta": max(0, mx.get_peak_memory() - active0),
        "rss_before": before.rss,
        "tokens": greedy(model),
    }
    if swap is not None:
        result["swap"] = {k: v for k, v in vars(swap).items()}
    print(json.dumps(result))


# ----------------------------------------------------------------------------
# Parent: prepare, run, summarize


def prepare(model_spec: str, tail: int, root: Path) -> dict:
    from pyloader import heads
    from benchlib.synthetic import make_model, make_variant
    from pyloader.io import Checkpoint

    if model_spec == "default":
        from pyloader.default_model import default_model_path

        base, label = Path(default_model_path()), "smollm2-135m-4bit"
    elif model_spec.startswith("synthetic:"):
        from pyloader.compare.system import parse_bytes as parse_size

        size = parse_size(model_spec.split(":", 1)[1])
        label = f"synthetic-llama-{model_spec.split(':', 1)[1]}-bf16"
        base = make_model(root / label / "base", size)
    else:
        base, label = Path(model_spec), Path(model_spec).name
    work = root / f"{label}-tail{tail}"
    work.mkdir(parents=True, exist_ok=True)
    spec = {"base": str(base), "tail": tail, "version": 1}
    marker = work / "spec.json"
    if not (marker.exists() and json.loads(marker.read_text()) == spec):
        t0 = time.perf_counter()
        v1 = make_variant(base, work / "variant1", tail, seed=1)
        v2 = make_variant(base, work / "variant2", tail, seed=2)
        heads.build(base, {"base": base, "chat": v1, "code": v2}, tail, work / "bundle",
                    overwrite=True)
        marker.write_text(json.dumps(spec))
        print(f"prepared {work} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    b = heads.Bundle(work / "bundle")
    head_bytes = b.heads["code"]["bytes"]
    model_bytes = Checkpoint(work / "variant2").total_nbytes
    return {"label": label, "base": str(base), "variant1": str(work / "variant1"),
            "variant2": str(work / "variant2"), "bundle": str(work / "bundle"),
            "head_bytes": head_bytes, "model_bytes": model_bytes, "tail": tail,
            "layers": b.layers}


def run_child(scenario: str, setup: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "child", "--scenario", scenario,
           "--bundle",
           setup["bundle"], "--variant1", setup["variant1"], "--variant2", setup["variant2"]]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{scenario} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def difference(after, before):
    """``after - before``, or None where either is not reported on this platform."""
    return None if after is None or before is None else after - before


def median(values):
    """The median, or None where a run did not report the figure."""
    values = list(values)
    return None if None in values else statistics.median(values)


def largest(values):
    """The maximum, or None where a run did not report the figure."""
    values = list(values)
    return None if None in values else max(values)


def mib(v) -> str:
    return "n/a" if v is None else f"{v / MiB:.1f}"


def summarize(setup: dict, runs: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["scenario"], []).append(r)
    med = {s: {k: median(r[k] for r in rs)
               for k in ("seconds", "rss_delta", "peak_rss_delta", "anon_delta",
                         "mlx_peak_delta")} for s, rs in by.items()}
    tokens = {s: rs[0]["tokens"] for s, rs in by.items()}
    ratio = setup["head_bytes"] / setup["model_bytes"]
    warm_ratio = med["swap-warm"]["seconds"] / med["reload-mlx-warm"]["seconds"]
    cold_ratio = med["swap-cold"]["seconds"] / med["reload-mlx-cold"]["seconds"]
    targets = {
        "warm_swap_over_warm_reload": {"value": warm_ratio, "target": 0.05,
                                       "met": warm_ratio <= 0.05},
        "cold_swap_over_cold_reload": {"value": cold_ratio, "target": 1.3 * ratio,
                                       "met": cold_ratio <= 1.3 * ratio},
    }
    warm_io = [r["swap"] for r in by["swap-warm"]]
    return {"setup": setup, "median": med, "targets": targets,
            "tokens_identical": len({tuple(t) for t in tokens.values()}) == 1,
            "tokens": tokens,
            "warm_swap_io": {k: largest(w[k] for w in warm_io)
                             for k in ("populate_bytes", "bytes_read", "rchar", "read_bytes")},
            "cold_swap_io": {k: median(r["swap"][k] for r in by["swap-cold"])
                             for k in ("populate_bytes", "bytes_read", "rchar", "read_bytes")},
            "runs": runs}


def render(rep: dict, command: str) -> str:
    s = rep["setup"]
    lines = [f"# Head swap: {s['label']} (tail {s['tail']} of {s['layers']} layers)", "",
             f"`{command}`", "",
             f"Head {s['head_bytes'] / MiB:.1f} MiB of {s['model_bytes'] / MiB:.1f} MiB "
             f"(ratio {s['head_bytes'] / s['model_bytes']:.3f}); "
             f"{len(rep['runs']) // len(SCENARIOS)} rounds, medians, each run a fresh process.",
             "",
             "| scenario | latency ms | x reload-mlx-warm | ΔRSS MiB | Δpeak RSS MiB | "
             "ΔRssAnon MiB | MLX peak Δ MiB |",
             "|---|---|---|---|---|---|---|"]
    base = rep["median"]["reload-mlx-warm"]["seconds"]
    for sc in SCENARIOS:
        m = rep["median"][sc]
        lines.append(f"| {sc} | {m['seconds'] * 1e3:.1f} | {m['seconds'] / base:.3f} | "
                     f"{mib(m['rss_delta'])} | {mib(m['peak_rss_delta'])} | "
                     f"{mib(m['anon_delta'])} | {mib(m['mlx_peak_delta'])} |")
    lines += ["", "Targets:"]
    for k, t in rep["targets"].items():
        lines.append(f"* {k}: {t['value']:.4f} (target ≤ {t['target']:.4f}) "
                     f"{'MET' if t['met'] else 'MISS'}")
    lines += ["", f"Warm swap I/O (max over rounds): {rep['warm_swap_io']}",
              f"Cold swap I/O (median): {rep['cold_swap_io']}",
              f"Greedy tokens identical across all scenarios: {rep['tokens_identical']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("--scenario", choices=SCENARIOS, required=True)
    c.add_argument("--bundle", required=True)
    c.add_argument("--variant1", required=True)
    c.add_argument("--variant2", required=True)
    p.add_argument("--model", default="default",
                   help="default (SmolLM2-135M 4-bit), synthetic:SIZE or a model directory")
    p.add_argument("--tail", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--work", default=os.path.join(
        os.environ.get("PYLOADER_CACHE", os.path.expanduser("~/.cache/pyloader")), "heads-bench"))
    p.add_argument("--out", default=str(RAW))
    args = p.parse_args(argv)
    if args.cmd == "child":
        child(args)
        return 0
    setup = prepare(args.model, args.tail, Path(args.work))
    env = environment()
    runs = []
    for r in range(args.rounds):
        for sc in SCENARIOS:  # interleaved: noise spreads over every scenario
            runs.append(run_child(sc, setup))
            print(f"round {r} {sc}: {runs[-1]['seconds'] * 1e3:.1f} ms", file=sys.stderr)
    rep = summarize(setup, runs)
    command = "python bench/heads_bench.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]))
    rep["command"] = command
    rep["env"] = env
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"heads-{setup['label']}-tail{args.tail}"
    (out / f"{name}.json").write_text(json.dumps(rep, indent=1))
    text = render(rep, command)
    (out / f"{name}.md").write_text(text)
    print(text)
    return 0 if rep["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
