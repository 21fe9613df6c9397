"""``pyloader compare``: loading strategies side by side, or the load benchmark."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .._util.fs import cache_dir
from ..compare import genbench, harness
from ..compare.plots import plot_report
from ..errors import PlotsUnavailable
from ..io.checkpoint import Checkpoint
from ..io.gguf_header import is_gguf
from ..streaming.resident import Residency
from .common import (
    check_choices,
    csv_list,
    default_model,
    fail,
    mlx_lm_missing,
    model_location,
)


def _safetensors_missing() -> str | None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return "the safetensors package is not installed"
    return None


def _bf16_missing(paths: list[str]) -> bool:
    """True when a checkpoint has bf16 tensors and ml_dtypes is missing."""
    try:
        import ml_dtypes  # noqa: F401
        return False
    except ImportError:
        pass
    return any(t.dtype == "BF16" for p in paths for t in Checkpoint(p).tensors())


def add_parser(sub) -> None:
    """``pyloader compare``."""
    c = sub.add_parser(
        "compare", help="compare the loading strategies on a model (the main job)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Load MODEL and generate with each strategy, each run in a fresh process with "
            "the page cache controlled, and measure load time, time to first token, prompt "
            "and decode tok/s, peak RSS, anonymous RSS, MLX peak memory and bytes read; "
            "every run's tokens are checked against plain mx.load + mlx-lm (a run that "
            "differs is flagged and left out of the medians; a GGUF file, which mlx-lm does "
            "not read, against mmap+kernels: mapped and computed in place). With no MODEL: "
            "the default real model (SmolLM2-135M-Instruct, 4-bit); a random-weight model "
            "of any size: python bench/synthetic.py in a clone. Writes results.json, "
            "runs.csv, summary.csv, table.txt and PNG plots to --out.\n\n"
            "--load-only runs the load benchmark instead: time and memory of loading "
            "checkpoints (default: the default model's, as stored and as mx.save_safetensors "
            "writes it) into a dict of arrays."),
        epilog=("strategies: mlx-lm (baseline), pread, mmap, mmap-prefetch, stream "
                "(at each --resident) and, for mixture-of-experts models when asked for, "
                "stream-experts (an expert cache of each --resident value: fraction, "
                "slots or budget); when asked for, pread-overlap and mmap-overlap "
                "(StreamOptions(overlap=True): reads overlap the first forward pass); configs "
                "ending in +kv use pyloader's preallocated KV cache, +kernels pyloader's "
                "CPU kernels (tokens checked against mlx-lm+kernels). Load-only strategies: "
                "mlx, pread, mmap, safetensors. "
                "Metrics: docs/benchmarks.md, docs/expert-streaming.md."))
    c.add_argument("model", nargs="*", metavar="MODEL",
                   help="mlx-lm model directory or GGUF file (default: the default model); with "
                        "--load-only, any number of .safetensors files or directories")
    c.add_argument("--strategies", type=csv_list, default=None, metavar="LIST",
                   help=f"comma-separated subset of {','.join(genbench.STRATEGIES)} "
                        f"(default: {','.join(genbench.DEFAULT_STRATEGIES)}; with --load-only: "
                        "mlx,pread,mmap,safetensors)")
    c.add_argument("--resident", type=csv_list, default=None, metavar="LIST",
                   help="residencies of the stream strategy, as generate's --resident reads "
                        "them (0.5, 50%%, 4layers, 600MB; a bare 1 is refused), and expert "
                        "caches of stream-experts (fractions, slots or byte budgets) "
                        f"(default {','.join(genbench.DEFAULT_RESIDENT)})")
    c.add_argument("--kv", type=csv_list, default=None, metavar="LIST",
                   help="KV caches: default (mlx-lm's), prealloc (pyloader.make_kv_cache) "
                        "(default: both)")
    c.add_argument("--kernels", type=csv_list, default=None, metavar="LIST",
                   help="the kernels computing the model: mlx (MLX's own ops), auto "
                        "(pyloader's CPU kernels: configs ending in +kernels) (default: both)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--cold", dest="cache", action="store_const", const="cold",
                   help="files evicted from the page cache before each run (default; "
                        "--load-only default: both)")
    g.add_argument("--warm", dest="cache", action="store_const", const="warm",
                   help="files read once before each run")
    g.add_argument("--both", dest="cache", action="store_const", const="both",
                   help="warm and cold")
    c.add_argument("--runs", type=int, default=None, metavar="N",
                   help="runs per configuration and cache state (default 2; --load-only: 3)")
    c.add_argument("--max-tokens", type=int, default=16, metavar="N",
                   help="greedy tokens generated per run (default 16)")
    c.add_argument("--prompt", default=None,
                   help="prompt text (default: a fixed English paragraph)")
    c.add_argument("--load-only", action="store_true",
                   help="the load benchmark: time to a dict of arrays, no generation")
    c.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    c.add_argument("--allow-misaligned", action="store_true",
                   help="--load-only mmap strategy: view misaligned tensors instead of "
                        "copying them")
    c.add_argument("--pread-backend", choices=("threads", "io_uring"), default=None,
                   help="--load-only pread strategy's reader backend")
    c.add_argument("--out", metavar="DIR",
                   help="output directory (default: compare/<time> under the pyloader "
                        "cache, $PYLOADER_CACHE or ~/.cache/pyloader)")
    c.set_defaults(func=main)


def mlx_written(model_dir: str) -> str:
    """The tensors of ``model_dir`` as ``mx.save_safetensors`` writes them (unaligned), written
    once into the cache beside the comparisons."""
    import mlx.core as mx

    from ..io.strategies import load

    stats = [os.stat(f) for f in Checkpoint(model_dir).files]
    key = f"{sum(s.st_size for s in stats)}-{max(s.st_mtime_ns for s in stats)}"
    name = os.path.basename(os.path.normpath(model_dir))
    out = cache_dir("compare") / f"{name}-{key}-mlx.safetensors"
    if not out.is_file():
        tmp = out.with_name(f".{out.stem}-{os.getpid()}.safetensors")
        mx.save_safetensors(str(tmp), load(model_dir))
        os.replace(tmp, out)
    return str(out)


def default_out() -> str:
    """Default ``--out``: ``compare/<date-time>`` under the pyloader cache."""
    return str(cache_dir("compare") / time.strftime("%Y%m%d-%H%M%S"))


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader compare``: the generation comparison, or the load benchmark."""
    if args.runs is None:
        args.runs = 3 if args.load_only else 2
    if args.runs < 1:
        return fail("compare", "--runs must be at least 1")
    if args.load_only:
        return _compare_load(args)
    return _compare_models(args)


def _model_for_compare(args: argparse.Namespace, gguf: bool = False) -> str:
    """The model directory (or ``gguf`` file) to compare on (built or converted when
    needed)."""
    if args.model:
        path = model_location(args.model[0])
        if gguf:
            return path
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"{path} is not an mlx-lm model directory (no config.json) or a GGUF file: "
                "pass a model, or use --load-only to compare loading bare checkpoints")
        return path
    return default_model(announce=True)


def _compare_models(args: argparse.Namespace) -> int:
    if len(args.model) > 1:
        return fail("compare", "compare one MODEL at a time (--load-only takes several)")
    if (status := mlx_lm_missing("compare")) is not None:
        return status
    # A GGUF file: mlx-lm does not read it, so the baseline is pyloader's in-place mapping
    # with its kernels (which alone compute every block format).
    gguf = bool(args.model) and is_gguf(args.model[0])  # a local file: no hub lookup
    workload = genbench.GGUF_WORKLOAD if gguf else genbench.WORKLOAD
    strategies = args.strategies or [s for s in genbench.DEFAULT_STRATEGIES
                                     if not (gguf and s == genbench.BASELINE)]
    kv_modes = args.kv or list(genbench.KV_MODES)
    kernel_modes = args.kernels or (["auto"] if gguf else list(genbench.KERNEL_MODES))
    why = (check_choices("strategy", strategies, genbench.STRATEGIES)
           or check_choices("KV cache", kv_modes, genbench.KV_MODES)
           or check_choices("kernels", kernel_modes, genbench.KERNEL_MODES))
    if gguf and genbench.BASELINE in strategies:
        why = f"{genbench.BASELINE} does not read GGUF files: the baseline is {workload.baseline}"
    if why:
        return fail("compare", why)
    residents = args.resident or list(genbench.DEFAULT_RESIDENT)
    if "stream" in strategies:  # layer residencies read as generate's --resident does
        for r in residents:
            try:
                Residency.from_text(r)
            except ValueError as exc:
                return fail("compare", f"--{exc}")
    configs = genbench.configurations(strategies, residents, kv_modes, kernel_modes,
                                      workload.baseline)
    try:
        for label in configs:
            genbench.Config.parse(label)
        path = _model_for_compare(args, gguf)
        case = harness.describe_case(os.path.basename(os.path.normpath(path)), path)
    except (OSError, ValueError, RuntimeError) as exc:  # FormatError is a ValueError
        return fail("compare", str(exc))
    caches = {"both": ["warm", "cold"], "warm": ["warm"], "cold": ["cold"],
              None: ["cold"]}[args.cache]
    out = args.out or default_out()
    options = {"max_tokens": args.max_tokens}
    if args.prompt is not None:
        options["prompt"] = args.prompt
    n = len(configs) * len(caches) * args.runs
    print(f"{n} runs: {', '.join(configs)} x {'/'.join(caches)} page cache x {args.runs}, "
          "each in a fresh process", file=sys.stderr, flush=True)
    report = harness.run_compare([case], configs, caches, args.runs, out,
                                 options=options, workload=workload)
    print(genbench.render(report))
    files = "results.json, runs.csv, summary.csv, table.txt"
    if not args.no_plots:
        try:
            plot_report(report, out)
            files += ", memory.png, tps_vs_resident.png"
        except PlotsUnavailable as exc:
            print(f"note: no plots: {exc}", file=sys.stderr)
    print(f"\nresults: {os.path.abspath(out)}/({files})")
    bad = any("error" in r or r.get("identical") is False for r in report["runs"])
    return 1 if bad else 0


def _compare_load(args: argparse.Namespace) -> int:
    explicit = args.strategies is not None
    strategies = args.strategies or list(harness.STRATEGIES)
    why = check_choices("strategy", strategies, harness.STRATEGIES)
    if why:
        return fail("compare", why)
    caches = {"both": ["warm", "cold"], "warm": ["warm"], "cold": ["cold"],
              None: ["warm", "cold"]}[args.cache]

    cases = []
    for i, name in enumerate(args.model):
        try:
            path = model_location(name)
        except FileNotFoundError as exc:
            return fail("compare", f"no such checkpoint: {exc}")
        label = os.path.basename(os.path.normpath(path)).removesuffix(".safetensors")
        if any(c.label == label for c in cases):
            label = f"{label}#{i}"
        try:
            cases.append(harness.describe_case(label, path))
        except (OSError, ValueError) as exc:  # FormatError is a ValueError
            return fail("compare", f"cannot open {path}: {exc}")
    if not args.model:
        try:
            stored = default_model(announce=True)
            cases.append(harness.describe_case("default", stored))
            cases.append(harness.describe_case("mlx-written", mlx_written(stored)))
        except (OSError, ValueError, RuntimeError) as exc:
            return fail("compare", str(exc))

    if "safetensors" in strategies:
        why = _safetensors_missing()
        if why is None and _bf16_missing([c.path for c in cases]):
            why = "bf16 tensors need the ml_dtypes package for safetensors' MLX loader"
        if why:
            if explicit:
                return fail("compare", f"cannot run the safetensors strategy: {why} "
                                        "(pip install safetensors ml_dtypes)")
            print(f"note: skipping the safetensors strategy: {why} "
                  "(pip install safetensors ml_dtypes)", file=sys.stderr)
            strategies = [s for s in strategies if s != "safetensors"]

    out = args.out or default_out()
    options = {}
    if args.allow_misaligned:
        options["allow_misaligned"] = True
    if args.pread_backend:
        options["backend"] = args.pread_backend
    report = harness.run_compare(cases, strategies, caches, args.runs, out, options=options)
    print(harness.render_load(report))
    print(f"\nresults: {os.path.abspath(out)}/(results.json, runs.csv, summary.csv, table.txt)")
    return 1 if any("error" in r for r in report["runs"]) else 0
