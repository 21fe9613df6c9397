"""``pyloader synthetic``: write a synthetic checkpoint or real-shape model."""

from __future__ import annotations

import argparse
import time

from .._util.sizes import format_bytes
from .. import synthetic
from ..synthetic import shapes
from ..synthetic import DTYPES, WRITERS
from ..io.checkpoint import Checkpoint
from .common import parse_size


def add_parser(sub) -> None:
    """``pyloader synthetic``."""
    c = sub.add_parser("synthetic", help="write a synthetic checkpoint or sharded model",
                       description="Write a deterministic llama-shaped checkpoint, or with "
                                   "--shape a sharded mlx-lm model directory of a real "
                                   "model's shape with random weights (nothing is written "
                                   "if PATH already holds the same one).")
    c.add_argument("path", metavar="PATH",
                   help="output .safetensors file (with --shape: a model directory)")
    c.add_argument("--shape", choices=list(shapes.SHAPES),
                   help="write this model's shape as a sharded directory (with an index)")
    c.add_argument("--format", choices=list(shapes.FORMATS), default="bf16",
                   help="with --shape: bf16, or q4 (mlx-lm affine 4-bit, group 64)")
    c.add_argument("--shard-size", type=parse_size, default=shapes.DEFAULT_SHARD_BYTES,
                   help="with --shape: bytes per shard (default 5GB)")
    c.add_argument("--tiny", action="store_true",
                   help="with --shape: the shape's small variant (same structure)")
    c.add_argument("--size", type=parse_size, default=1 << 30,
                   help="approximate tensor bytes (default 1GiB)")
    c.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    c.add_argument("--writer", choices=list(WRITERS), default="safetensors",
                   help="safetensors: padded header, aligned tensors; mlx: "
                        "mx.save_safetensors layout, misaligned tensors")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader synthetic``."""
    t0 = time.monotonic()
    if args.shape:
        out = shapes.make_sharded_model(args.path, args.shape, args.format, seed=args.seed,
                                        shard_bytes=args.shard_size, tiny=args.tiny)
        c = Checkpoint(out)
        what = (f"{args.shape} {args.format}, {len(c.files)} shards, {len(c)} tensors, "
                f"{format_bytes(c.total_nbytes)}")
    else:
        out = synthetic.make_checkpoint(args.path, args.size, args.dtype, args.writer,
                                        args.seed)
        c = Checkpoint(out)
        what = f"{len(c)} tensors, {c.total_nbytes / 2**20:.1f} MiB"
    a = c.alignment_summary()
    print(f"{out}: {what}, {a['aligned_tensors']}/{a['tensors']} tensors aligned "
          f"({time.monotonic() - t0:.1f} s)")
    return 0
