"""The ``pyloader`` command.

``pyloader compare`` is the load benchmark (see ``docs/benchmarks.md``);
``pyloader generate`` writes a synthetic checkpoint; ``pyloader plan`` plans a
model's memory (see ``docs/memory-planning.md``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"1GiB"`` → 1073741824, ``"512MiB"``, ``"1.5G"``, ``"4096"``; binary
    (KiB/MiB/GiB) and decimal (kB/MB/GB, k/M/G) units."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number with an optional unit, e.g. 1GiB, 512MiB, 2G")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def _strategies(text: str) -> list[str]:
    from ._measure import STRATEGIES

    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(bad) or '(none)'}; choose from {','.join(STRATEGIES)}")
    return list(dict.fromkeys(names))


def _safetensors_missing() -> str | None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return "the safetensors package is not installed"
    return None


def _bf16_missing(paths: list[str]) -> bool:
    """True when a checkpoint has bfloat16 tensors and ml_dtypes is missing:
    safetensors' MLX loader goes through numpy, which needs ml_dtypes for bf16."""
    try:
        import ml_dtypes  # noqa: F401
        return False
    except ImportError:
        pass
    from .checkpoint import Checkpoint

    return any(t.dtype == "BF16" for p in paths for t in Checkpoint(p).tensors())


def cmd_compare(args: argparse.Namespace) -> int:
    from . import compare, synthetic

    explicit = args.strategies is not None
    strategies = args.strategies or list(compare.STRATEGIES)
    caches = {"both": ["warm", "cold"], "warm": ["warm"], "cold": ["cold"]}[args.cache]

    cases = []
    for i, path in enumerate(args.checkpoints):
        if not os.path.exists(path):
            print(f"pyloader compare: no such checkpoint: {path}", file=sys.stderr)
            return 2
        label = os.path.basename(os.path.normpath(path)).removesuffix(".safetensors")
        if any(c.label == label for c in cases):
            label = f"{label}#{i}"
        try:
            cases.append(compare.describe_case(label, path))
        except (OSError, ValueError) as exc:  # FormatError is a ValueError
            print(f"pyloader compare: cannot open {path}: {exc}", file=sys.stderr)
            return 2
    if not args.checkpoints or args.synthetic is not None:
        size = args.synthetic or (1 << 30)
        print(f"synthetic checkpoints ({synthetic.format_size(size)} bf16, cached in "
              f"{os.path.join(synthetic.cache_dir(), 'synthetic')}) ...", file=sys.stderr,
              flush=True)
        t0 = time.monotonic()
        pair = synthetic.synthetic_pair(size)
        print(f"  ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        cases.append(compare.describe_case("aligned", pair["safetensors"]))
        cases.append(compare.describe_case("mlx-written", pair["mlx"]))

    if "safetensors" in strategies:
        why = _safetensors_missing()
        if why is None and _bf16_missing([c.path for c in cases]):
            why = "bf16 tensors need the ml_dtypes package for safetensors' MLX loader"
        if why:
            if explicit:
                print(f"pyloader compare: cannot run the safetensors strategy: {why} "
                      "(pip install safetensors ml_dtypes)", file=sys.stderr)
                return 2
            print(f"note: skipping the safetensors strategy: {why} "
                  "(pip install safetensors ml_dtypes)", file=sys.stderr)
            strategies = [s for s in strategies if s != "safetensors"]

    out = args.out or f"pyloader-compare-{time.strftime('%Y%m%d-%H%M%S')}"
    options = {}
    if args.allow_misaligned:
        options["allow_misaligned"] = True
    if args.pread_backend:
        options["backend"] = args.pread_backend
    report = compare.run_compare(cases, strategies, caches, args.runs, out, options=options)
    print(compare.render(report))
    print(f"\nresults: {os.path.abspath(out)}/(results.json, runs.csv, summary.csv, table.txt)")
    return 1 if any("error" in r for r in report["runs"]) else 0


def cmd_generate(args: argparse.Namespace) -> int:
    from . import synthetic

    t0 = time.monotonic()
    path = synthetic.make_checkpoint(args.path, args.size, args.dtype, args.writer, args.seed)
    from .checkpoint import Checkpoint

    c = Checkpoint(path)
    a = c.alignment_summary()
    print(f"{path}: {len(c)} tensors, {c.total_nbytes / 2**20:.1f} MiB, "
          f"{a['aligned_tensors']}/{a['tensors']} tensors aligned "
          f"({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from . import residency

    target = args.model
    if target is None:
        from .default_model import default_model_path

        target = str(default_model_path())
    if not os.path.exists(target):
        print(f"pyloader plan: no such model directory or config: {target}", file=sys.stderr)
        return 2
    quant = ({"bits": args.bits, "group_size": args.group_size} if args.bits else None)
    kv_bits = None if args.kv_bits == 16 else args.kv_bits
    try:
        budget = residency.model_budget(target, kv_bits=kv_bits, quantization=quant)
        cal = None
        if not args.no_predict:
            cal = (residency.calibrate(target, force=True, budget=budget) if args.calibrate
                   else residency.cached_calibration(target, budget))
            if cal is None:
                print("measuring this machine once (disk and compute; cached) ...",
                      file=sys.stderr, flush=True)
                cal = residency.calibrate_machine(residency._format_of(budget))
        p = residency.plan(target, args.ram if args.ram is not None else "auto",
                           priority=args.priority, context=args.context, kv_bits=kv_bits,
                           calibration=cal, model=budget)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pyloader plan: {target}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict(), indent=1) if args.json else p.render())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="pyloader",
        description="Fast, lean loading of safetensors checkpoints for MLX.")
    p.add_argument("--version", action="version", version=f"pyloader {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser(
        "compare", help="benchmark the loading strategies (the main job)",
        description=(
            "Time and measure loading every CHECKPOINT with each strategy, warm and cold, "
            "each run in a fresh process. With no CHECKPOINT, a synthetic llama-shaped "
            "checkpoint is generated once (cached under $PYLOADER_CACHE or "
            "~/.cache/pyloader) and written twice: by safetensors (aligned) and by "
            "mx.save_safetensors (misaligned)."),
        epilog="Metrics and targets: docs/benchmarks.md.")
    c.add_argument("checkpoints", nargs="*", metavar="CHECKPOINT",
                   help="a .safetensors file or a model directory")
    c.add_argument("--synthetic", type=parse_size, default=None, metavar="SIZE",
                   help="size of the synthetic checkpoints (default 1GiB); they are compared "
                        "when no CHECKPOINT is given or when this option is")
    c.add_argument("--strategies", type=_strategies, default=None,
                   metavar="LIST", help="comma-separated subset of mlx,pread,mmap,safetensors "
                                        "(default: all)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--cold", dest="cache", action="store_const", const="cold",
                   help="only cold page cache (files evicted before each run)")
    g.add_argument("--warm", dest="cache", action="store_const", const="warm",
                   help="only warm page cache (files read once before each run)")
    g.add_argument("--both", dest="cache", action="store_const", const="both",
                   help="warm and cold (default)")
    c.set_defaults(cache="both")
    c.add_argument("--runs", type=int, default=3, metavar="N",
                   help="runs per strategy and cache state (default 3)")
    c.add_argument("--allow-misaligned", action="store_true",
                   help="mmap strategy: view misaligned tensors instead of copying them "
                        "(opt-in until every kernel is proven on misaligned data)")
    c.add_argument("--pread-backend", choices=("threads", "io_uring"), default=None,
                   help="pread strategy's reader backend (default: the loader's, threads)")
    c.add_argument("--out", metavar="DIR",
                   help="output directory (default ./pyloader-compare-<time>)")
    c.set_defaults(func=cmd_compare)

    from .synthetic import DTYPES, WRITERS

    gen = sub.add_parser("generate", help="write a synthetic llama-shaped checkpoint",
                         description="Write a deterministic llama-shaped checkpoint "
                                     "(nothing is written if PATH already holds the same one).")
    gen.add_argument("path", metavar="PATH", help="output .safetensors file")
    gen.add_argument("--size", type=parse_size, default=1 << 30,
                     help="approximate tensor bytes (default 1GiB)")
    gen.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    gen.add_argument("--writer", choices=list(WRITERS), default="safetensors",
                     help="safetensors: padded header, aligned tensors; mlx: "
                          "mx.save_safetensors layout, misaligned tensors")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)
    pl = sub.add_parser(
        "plan", help="memory table, max context, resident set and predicted tok/s",
        description="Plan a model for a memory budget: weights (from the checkpoint index, or "
                    "from config.json shapes), KV cache per token (only layers that keep one; "
                    "windows capped), activations, runtime reserve; whether it fits, the max "
                    "context, the resident layers and the predicted prefill/decode tok/s "
                    "(from a calibration measured once and cached).",
        epilog="Details: docs/memory-planning.md.")
    pl.add_argument("model", nargs="?", metavar="PATH_OR_CONFIG",
                    help="model directory or config.json (default: the default model)")
    pl.add_argument("--ram", type=parse_size, default=None, metavar="SIZE",
                    help="memory budget for the whole process, e.g. 6GB (default: auto, from "
                         "MemAvailable and this process's cgroup)")
    pl.add_argument("--context", type=int, default=None, metavar="TOKENS",
                    help="expected context (default: min(model max, 4096))")
    pl.add_argument("--kv-bits", type=int, choices=(16, 8, 4), default=16,
                    help="KV cache precision (16: the model's float dtype)")
    pl.add_argument("--priority", choices=("max_tps", "balanced", "max_context"),
                    default="balanced",
                    help="KV reserve: 512 tokens, 1024, or the whole context (default balanced)")
    pl.add_argument("--bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None,
                    help="config only: budget the weights quantized to this many bits")
    pl.add_argument("--group-size", type=int, default=64, help="with --bits (default 64)")
    pl.add_argument("--calibrate", action="store_true",
                    help="re-measure the calibration (the checkpoint's own when it has weights)")
    pl.add_argument("--no-predict", action="store_true", help="no tok/s prediction")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "runs", 1) < 1:
        parser.error("--runs must be at least 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
