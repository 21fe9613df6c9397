"""Write the synthetic data the tests and benchmarks use: a deterministic checkpoint
(aligned or as ``mx.save_safetensors`` writes it), a random-weight mlx-lm model of a given
size (``--model``), or a sharded directory of a real model's shape (``--shape``)::

    python bench/synthetic.py /tmp/s.safetensors --size 1GiB --writer mlx
    python bench/synthetic.py /tmp/llama --model llama --size 2GB   # for pyloader compare
    python bench/synthetic.py /tmp/moe --model qwen3_moe --size 1.2GB   # for stream-experts
    python bench/synthetic.py /tmp/8b --shape llama3.1-8b --format q4

Nothing is written if PATH already holds the same one.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchlib import synthetic
from benchlib.synthetic import DTYPES, WRITERS, shapes
from benchlib.synthetic.models import MODEL_ARCHS
from pyloader.cli.common import parse_size
from pyloader.compare.system import format_bytes
from pyloader.io.checkpoint import Checkpoint


def parser() -> argparse.ArgumentParser:
    """The script's arguments."""
    c = argparse.ArgumentParser(prog="bench/synthetic.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("path", metavar="PATH",
                   help="output .safetensors file (with --model or --shape: a directory)")
    what = c.add_mutually_exclusive_group()
    what.add_argument("--model", choices=(*MODEL_ARCHS, "qwen3_moe"),
                      help="a random-weight mlx-lm model of about --size bytes (qwen3_moe: "
                           "4-bit, 64 experts, routing with locality)")
    what.add_argument("--shape", choices=list(shapes.SHAPES),
                      help="this model's shape as a sharded directory (with an index)")
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
    return c


def main(argv: list[str] | None = None) -> int:
    """Write what the arguments ask for; print what was written."""
    args = parser().parse_args(argv)
    t0 = time.monotonic()
    if args.shape:
        out = shapes.make_sharded_model(args.path, args.shape, args.format, seed=args.seed,
                                        shard_bytes=args.shard_size, tiny=args.tiny)
        what = f"{args.shape} {args.format}"
    elif args.model == "qwen3_moe":
        out, what = synthetic.make_moe_model(args.path, args.size, seed=args.seed), "qwen3_moe"
    elif args.model:
        out = synthetic.make_model(args.path, args.size, dtype=args.dtype, seed=args.seed,
                                   arch=args.model)
        what = f"{args.model} {args.dtype}"
    else:
        out = synthetic.make_checkpoint(args.path, args.size, args.dtype, args.writer,
                                        args.seed)
        what = f"{args.dtype} checkpoint"
    c = Checkpoint(out)
    a = c.alignment_summary()
    n = len(c.files)
    print(f"{out}: {what}, {n} shard{'s' * (n != 1)}, {len(c)} tensors, "
          f"{format_bytes(c.total_nbytes)}, {a['aligned_tensors']}/{a['tensors']} tensors "
          f"aligned ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
