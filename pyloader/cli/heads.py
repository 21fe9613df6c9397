"""``pyloader heads build``: one trunk + swappable task heads (:mod:`pyloader.heads`)."""

from __future__ import annotations

import argparse
import time

from .. import heads
from ..io.writer import DEFAULT_ALIGN
from .common import fail, model_location


def _head_spec(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=CHECKPOINT, got {text!r}")
    return name, path


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader heads build``: write a trunk + heads bundle."""
    specs = dict(args.head)
    if len(specs) != len(args.head):
        return fail("heads build", "a head name is given twice")
    t0 = time.monotonic()
    try:
        specs = {name: model_location(path) for name, path in specs.items()}
        r = heads.build(model_location(args.base), specs, args.tail, args.out,
                        align=args.align, overwrite=args.overwrite)
    except (OSError, ValueError, heads.HeadError) as exc:
        return fail("heads build", str(exc))
    print(f"{r.path}: trunk {r.trunk_tensors} tensors ({r.trunk_bytes / 2**20:.1f} MiB, "
          f"{r.layers - r.tail} of {r.layers} layers); heads: "
          + ", ".join(f"{n} ({b / 2**20:.1f} MiB)" for n, b in r.heads.items())
          + f" ({time.monotonic() - t0:.1f} s)")
    return 0


def add_parser(sub) -> None:
    """``pyloader heads`` (``heads build``)."""
    hd = sub.add_parser("heads", help="task-head bundles (trunk once, swappable heads)")
    hsub = hd.add_subparsers(dest="heads_command", metavar="ACTION")
    hb = hsub.add_parser("build", help="build a head bundle",
                         description="Store BASE's trunk once and the last K layers, final "
                                     "norm and lm_head of each variant as a head; refuses "
                                     "variants whose trunk differs from BASE.")
    hb.add_argument("base", metavar="BASE",
                    help="base model directory (or a Hugging Face repo id in the hub cache)")
    hb.add_argument("--head", type=_head_spec, action="append", required=True,
                    metavar="NAME=CHECKPOINT", help="a head and its variant's model directory "
                                                    "(repeat for each head)")
    hb.add_argument("--tail", type=int, required=True, metavar="K",
                    help="decoder layers in each head (the last K)")
    hb.add_argument("out", metavar="OUT", help="bundle directory to write")
    hb.add_argument("--align", type=int, default=DEFAULT_ALIGN,
                    help=f"boundary in bytes (default {DEFAULT_ALIGN})")
    hb.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    hb.set_defaults(func=main)
