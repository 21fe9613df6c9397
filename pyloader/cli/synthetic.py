"""``pyloader synthetic``: write a deterministic llama-shaped checkpoint
(:mod:`pyloader.bench.synthetic`)."""

from __future__ import annotations

import argparse
import time

from ..bench import synthetic
from ..bench.synthetic import DTYPES, WRITERS
from ..io.checkpoint import Checkpoint
from .common import parse_size


def add_parser(sub) -> None:
    """``pyloader synthetic``."""
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
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader synthetic``."""
    t0 = time.monotonic()
    path = synthetic.make_checkpoint(args.path, args.size, args.dtype, args.writer, args.seed)
    c = Checkpoint(path)
    a = c.alignment_summary()
    print(f"{path}: {len(c)} tensors, {c.total_nbytes / 2**20:.1f} MiB, "
          f"{a['aligned_tensors']}/{a['tensors']} tensors aligned "
          f"({time.monotonic() - t0:.1f} s)")
    return 0
