"""``pyloader generate``: stream a greedy continuation from a model loaded (or streamed)
by pyloader (:mod:`pyloader.generation`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from ..errors import PlotsUnavailable
from ..streaming.timeline import summary_line
from ..streaming.trace import require_pyplot, trace
from .common import (
    add_residency_arguments,
    default_model,
    fail,
    mlx_lm_missing,
    resident_of,
)


def add_parser(sub) -> None:
    """``pyloader generate``."""
    c = sub.add_parser(
        "generate", help="generate text from a model loaded (or streamed) by pyloader",
        description="Load MODEL (default: the default model) with the chosen strategy, "
                    "stream the greedy continuation of --prompt to stdout and print a stats "
                    "line to stderr.")
    c.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="mlx-lm model directory (default: the default model)")
    c.add_argument("--prompt", required=True)
    add_residency_arguments(c)
    c.add_argument("--max-tokens", type=int, default=64, metavar="N")
    c.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
    c.add_argument("--kv-prealloc", action="store_true",
                   help="use pyloader's preallocated KV cache")
    c.add_argument("--trace", default=None, metavar="FILE.json",
                   help="write a timeline of every streamed unit (read issued and done, "
                        "wait, compute, release, eviction) and of the reader threads as "
                        "Chrome trace-event JSON (open it in ui.perfetto.dev or "
                        "chrome://tracing), plus a PNG summary")
    c.add_argument("--trace-png", default=None, metavar="FILE.png",
                   help="where the trace's PNG summary goes (default: beside --trace, "
                        "with .png; needs matplotlib)")
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader generate``."""
    if args.max_tokens < 1:
        return fail("generate", "--max-tokens must be at least 1")
    if (status := mlx_lm_missing("generate")) is not None:
        return status
    if args.trace_png is not None and args.trace is None:
        return fail("generate", "--trace-png needs --trace FILE.json")
    png = args.trace_png
    for out in (args.trace, png):
        if out is not None and not Path(out).resolve().parent.is_dir():
            return fail("generate", f"{out}: no such directory")
    if args.trace is not None:
        try:
            require_pyplot()
            if png is None:
                png = str(Path(args.trace).with_suffix(".png"))
        except PlotsUnavailable as exc:
            if png is not None:
                return fail("generate", str(exc))
            print(f"pyloader generate: no PNG summary of the trace: {exc}", file=sys.stderr)
    from ..generation import generate_text, load_for_generation  # needs mlx-lm

    try:
        resident = resident_of(args)
    except ValueError as exc:
        return fail("generate", str(exc))
    try:
        if args.model is None:
            args.model = default_model()
        model, tokenizer, load_s = load_for_generation(args.model, strategy=args.strategy,
                                                       resident=resident)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        return fail("generate", f"{type(exc).__name__}: {exc}", 1)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    recording = (trace(model, args.trace, png=png) if args.trace is not None
                 else contextlib.nullcontext())
    with recording as timeline:
        _, stats = generate_text(model, tokenizer, args.prompt, max_tokens=args.max_tokens,
                                 chat=args.chat, preallocate_kv=args.kv_prealloc, on_text=show)
    stats.load_s = load_s
    sys.stdout.write("\n")
    print(stats.line(), file=sys.stderr)
    if timeline is not None:
        written = args.trace + (f" and {png}" if png is not None else "")
        print(f"trace: {written}: {summary_line(timeline.summary())}", file=sys.stderr)
    return 0
