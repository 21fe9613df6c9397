"""The ``pyloader`` command.

``pyloader compare`` is the load benchmark (see ``docs/benchmarks.md``);
``pyloader generate`` writes a synthetic checkpoint.
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


def cmd_repack(args: argparse.Namespace) -> int:
    from .repack import repack

    t0 = time.monotonic()
    try:
        r = repack(args.src, args.dst, align=args.align, overwrite=args.overwrite)
    except (OSError, ValueError) as exc:  # FormatError is a ValueError
        print(f"pyloader repack: {exc}", file=sys.stderr)
        return 2
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
    from . import heads

    specs = dict(args.head)
    if len(specs) != len(args.head):
        print("pyloader heads build: a head name is given twice", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        r = heads.build(args.base, specs, args.tail, args.out, align=args.align,
                        overwrite=args.overwrite)
    except (OSError, ValueError, heads.HeadError) as exc:
        print(f"pyloader heads build: {exc}", file=sys.stderr)
        return 2
    print(f"{r.path}: trunk {r.trunk_tensors} tensors ({r.trunk_bytes / 2**20:.1f} MiB, "
          f"{r.layers - r.tail} of {r.layers} layers); heads: "
          + ", ".join(f"{n} ({b / 2**20:.1f} MiB)" for n, b in r.heads.items())
          + f" ({time.monotonic() - t0:.1f} s)")
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
