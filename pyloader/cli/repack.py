"""``pyloader repack``: rewrite a checkpoint with every tensor a zero-copy view."""

from __future__ import annotations

import argparse
import time

from ..io.repack import repack, repack_in_place
from .common import fail, model_location


def add_parser(sub) -> None:
    """``pyloader repack``."""
    rp = sub.add_parser("repack", help="rewrite a checkpoint with every tensor aligned",
                        description="Write SRC to DST (atomically), or rewrite SRC shard by "
                                    "shard with --in-place, with every tensor aligned and "
                                    "ordered by layer; still a plain safetensors checkpoint "
                                    "(docs/heads-and-repack.md).")
    rp.add_argument("src", metavar="SRC", help="a .safetensors file or a model directory")
    rp.add_argument("dst", metavar="DST", nargs="?", help="output file or directory")
    rp.add_argument("--in-place", action="store_true",
                    help="rewrite SRC itself, one shard at a time (temporary space: one "
                         "shard); shards already aligned are left alone")
    rp.add_argument("--align", type=int, default=None,
                    help="put every tensor on this boundary (a power of two >= 8), with "
                         "padding entries that strict mlx_lm.load refuses (default: each "
                         "tensor on its dtype's boundary, nothing added)")
    rp.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    rp.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader repack``: rewrite a checkpoint with every tensor aligned."""
    t0 = time.monotonic()
    if args.in_place == (args.dst is not None):
        return fail("repack", "give DST or --in-place (one of them)")
    try:
        if args.in_place:  # a local path: a hub cache's files are not ours to rewrite
            r = repack_in_place(args.src, align=args.align)
        else:
            r = repack(model_location(args.src), args.dst, align=args.align,
                       overwrite=args.overwrite)
    except (OSError, ValueError) as exc:  # FormatError is a ValueError
        return fail("repack", str(exc))
    layout = ("its dtype's boundary" if r.align is None
              else f"a {r.align}-byte boundary")
    print(f"{r.dst}: {r.tensors} tensors ({r.tensor_bytes / 2**20:.1f} MiB) in "
          f"{len(r.files)} file(s) rewritten, every tensor on {layout}; "
          f"{r.pad_entries} padding entries ({r.pad_bytes / 2**20:.1f} MiB), "
          f"{len(r.copied_files)} other files copied ({time.monotonic() - t0:.1f} s)")
    return 0
