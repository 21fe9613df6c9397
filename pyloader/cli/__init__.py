"""The ``pyloader`` command: a dispatcher over the subcommand modules (:data:`COMMANDS`)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings

from .._version import __version__

#: Subcommand → the module of this package that implements it.
COMMANDS = {
    "compare": "compare",
    "generate": "generate",
    "inspect": "inspect",
    "convert-gguf": "convert_gguf",
    "repack": "repack",
    "heads": "heads",
    "plan": "plan",
    "serve": "serve",
    "launch": "launch",
    "fetch-default-model": "fetch_model",
}


def io_uring_text(available: bool, built: bool, portable_io: bool) -> str:
    """``pyloader --version``'s io_uring answer, with the reason when it is no."""
    if available:
        return "yes"
    if portable_io:
        also = ("" if built else "; this build has no io_uring either (built without "
                "liburing-dev)")
        return f"no (turned off by PYLOADER_PORTABLE_IO=1: unset it to use io_uring{also})"
    if not built:
        return ("no (built without liburing-dev: apt-get install liburing-dev, then "
                "reinstall pyloader to build it in)")
    return ("no (built in, but the kernel refuses io_uring to this process: "
            "io_uring_queue_init fails, e.g. under a seccomp profile or with "
            "sysctl kernel.io_uring_disabled set)")


def version_text() -> str:
    """``pyloader --version``: version, distribution, MLX and the available read paths."""
    import mlx.core as mx

    from .._native import core

    uring = io_uring_text(core.uring_available(), core.uring_built(),
                          core.platform()["portable_io"])
    return (f"pyloader {__version__} (distribution pyloader-mlx)\n"
            f"MLX {mx.__version__} (built against {core.mlx_build_version}), "
            f"device {mx.default_device().type.name}\n"
            f"readers: mmap, pread (threads); io_uring: {uring}")


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version, MLX's and the readers this build has, and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The ``pyloader`` argument parser with every subcommand of :data:`COMMANDS`."""
    p = argparse.ArgumentParser(
        prog="pyloader",
        description="Fast, lean loading and streaming of LLM weights for MLX.")
    p.add_argument("--version", action=_Version)
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="show the library's log messages (-v: info, -vv: debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(f"{__name__}.{module}").add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pyloader`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    formatted = warnings.formatwarning
    warnings.formatwarning = _format_warning
    try:
        return args.func(args)
    except BrokenPipeError:
        # Reader went away (`pyloader plan | head`): exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    finally:
        warnings.formatwarning = formatted


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as one line for a command's user (no source file or line of code)."""
    return f"pyloader: {category.__name__}: {message}\n"


if __name__ == "__main__":
    sys.exit(main())
