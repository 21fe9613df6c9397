"""``pyloader repack``: rewrite a checkpoint with every tensor on a boundary
(:mod:`pyloader.io.repack`)."""

from __future__ import annotations

import argparse
import time

from ..io.repack import repack
from ..io.writer import DEFAULT_ALIGN
from .common import fail


def add_parser(sub) -> None:
    """``pyloader repack``."""
    rp = sub.add_parser("repack", help="rewrite a checkpoint with every tensor aligned",
                        description="Write SRC to DST (atomically) with every tensor on an "
                                    "ALIGN-byte boundary, ordered by layer; still a plain "
                                    "safetensors checkpoint (docs/heads-and-repack.md).")
    rp.add_argument("src", metavar="SRC", help="a .safetensors file or a model directory")
    rp.add_argument("dst", metavar="DST", help="output file or directory")
    rp.add_argument("--align", type=int, default=DEFAULT_ALIGN,
                    help=f"boundary in bytes, a power of two >= 8 (default {DEFAULT_ALIGN})")
    rp.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    rp.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader repack``: rewrite a checkpoint with every tensor aligned."""
    t0 = time.monotonic()
    try:
        r = repack(args.src, args.dst, align=args.align, overwrite=args.overwrite)
    except (OSError, ValueError) as exc:  # FormatError is a ValueError
        return fail("repack", str(exc))
    print(f"{r.dst}: {r.tensors} tensors ({r.tensor_bytes / 2**20:.1f} MiB) in "
          f"{len(r.files)} file(s), every tensor on a {r.align}-byte boundary; "
          f"{r.pad_entries} padding entries ({r.pad_bytes / 2**20:.1f} MiB), "
          f"{len(r.copied_files)} other files copied ({time.monotonic() - t0:.1f} s)")
    return 0
