"""``python -m pyloader.bench.child WORKLOAD [--no-wait] [--result-file F] ARGS...``: one
measuring child (:mod:`pyloader.bench.protocol`) running one workload of
:data:`pyloader.bench.workloads.WORKLOADS`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .protocol import serve
from .workloads import WORKLOADS


def main(argv: list[str] | None = None) -> int:
    """Parse ``WORKLOAD`` and its arguments, then serve one measurement."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in WORKLOADS:
        print(f"usage: python -m pyloader.bench.child {{{','.join(WORKLOADS)}}} ...",
              file=sys.stderr)
        return 2
    name = argv[0]
    module = importlib.import_module(WORKLOADS[name])
    p = argparse.ArgumentParser(prog=f"python -m pyloader.bench.child {name}",
                                description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-wait", action="store_true",
                   help="do not wait for 'go' on stdin (a child started by a launcher)")
    p.add_argument("--result-file", default=None,
                   help="also write the result (JSON) to this file; '{rank}' is replaced "
                        "by MLX_RANK (set by mlx.launch; default 0)")
    module.add_arguments(p)
    args = p.parse_args(argv[1:])
    result_file = args.result_file
    if result_file:
        result_file = result_file.replace("{rank}", os.environ.get("MLX_RANK", "0"))
    return serve(lambda: module.prepare(args), lambda state: module.run(args, state),
                 wait=not args.no_wait, result_file=result_file)


if __name__ == "__main__":
    sys.exit(main())
