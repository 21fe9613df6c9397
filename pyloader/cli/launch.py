"""``pyloader launch``: ``mlx.launch`` with its ranks' exit status."""

from __future__ import annotations

import argparse

from ..launcher import launch
from .common import fail

USAGE = "pyloader launch [MLX_LAUNCH_OPTIONS ...] -- COMMAND [ARGS ...]"
DESCRIPTION = (
    "Run COMMAND on every rank with mlx.launch (its options as given, e.g. --backend ring "
    "-n 2, --hostfile FILE) and exit with status 0 only when every rank's command exited "
    "with 0. mlx.launch itself exits 0 when a rank fails or is killed; this names the "
    "ranks that did and exits 1. Each rank's command runs under `python -m "
    "pyloader.launcher`, which reports its exit status on the rank's output.")


def add_parser(sub) -> None:
    """``pyloader launch``: arguments are taken verbatim ('+' prefixes only)."""
    c = sub.add_parser("launch", usage=USAGE, add_help=False, prefix_chars="+",
                       help="mlx.launch whose exit status fails when any rank fails",
                       description=DESCRIPTION)
    c.add_argument("argv", nargs=argparse.REMAINDER)
    c.set_defaults(func=main, launch_help=c.format_help)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader launch``."""
    argv = list(args.argv)
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        print(args.launch_help())
        return 0 if argv else 2
    if "--" not in argv:
        return fail("launch", "give the command after --: " + USAGE)
    cut = argv.index("--")
    try:
        result = launch(argv[:cut], argv[cut + 1:])
    except (ValueError, FileNotFoundError) as exc:
        return fail("launch", str(exc).removeprefix("pyloader launch: "))
    return result.status
