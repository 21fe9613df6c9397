"""``pyloader inspect``: what a checkpoint holds, from its headers."""

from __future__ import annotations

import argparse
import json

from ..errors import FormatError
from ..io.inspect import format_inspection, inspect_checkpoint
from .common import fail


def add_parser(sub) -> None:
    """``pyloader inspect``."""
    c = sub.add_parser(
        "inspect", help="summarize a checkpoint from its headers and check its format",
        description="Header summary, tensors grouped by layer, dtype mix, alignment "
                    "(zero-copy-able at item size and at page alignment) and quantization "
                    "layout of a .safetensors file or model directory. A file that breaks a "
                    "format rule prints the error and exits with status 1.")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader inspect``."""
    try:
        info = inspect_checkpoint(args.path)
    except FormatError as exc:
        return fail("inspect", f"invalid checkpoint: {exc}", 1)
    except (OSError, ValueError) as exc:
        return fail("inspect", f"{type(exc).__name__}: {exc}", 1)
    print(json.dumps(info, indent=1) if args.json else format_inspection(info))
    return 0
