"""``pyloader convert-gguf``: a GGUF file -> an mlx-lm model directory."""

from __future__ import annotations

import argparse
import time

from .._util.fs import describe_path
from ..errors import FormatError, UnsupportedError
from ..io.gguf import DTYPES, convert_gguf
from .common import fail


def add_parser(sub) -> None:
    """``pyloader convert-gguf``."""
    c = sub.add_parser(
        "convert-gguf", help="convert a GGUF file into an mlx-lm model directory",
        description="Write config.json (with mlx-lm's quantization block when the weights "
                    "stay quantized), model.safetensors and the tokenizer files built from "
                    "the GGUF metadata, every weight exact (a llama's Q/K rows in Hugging "
                    "Face order).")
    c.add_argument("input", metavar="IN.gguf")
    c.add_argument("output", metavar="OUT_DIR")
    c.add_argument("--dtype", choices=DTYPES, default="keep",
                   help="keep: the formats MLX computes exactly stay MLX-quantized, Q2_K/Q3_K/"
                        "Q6_K become float32 (default); bf16/f16/f32: dequantize and cast "
                        "every tensor")
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader convert-gguf``."""
    what, err = describe_path(args.input)
    if err:
        return fail("convert-gguf", f"{args.input}: {what}, not a GGUF file")
    t0 = time.monotonic()
    try:
        out = convert_gguf(args.input, args.output, args.dtype)
    except (FormatError, UnsupportedError, OSError, ValueError) as exc:
        return fail("convert-gguf", f"{type(exc).__name__}: {exc}", 1)
    files = sorted(p.name for p in out.iterdir())
    print(f"{out}: {', '.join(files)} ({time.monotonic() - t0:.1f} s); "
          f"load it with mlx_lm.load({str(out)!r}) or pyloader.load_model")
    return 0
