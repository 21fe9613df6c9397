"""``python -m pyloader.compare.child WORKLOAD ARGS...``: one measuring child."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from .protocol import serve
from .workloads import WORKLOADS


def load_workload(name: str):
    """The module of workload ``name``: one of :data:`WORKLOADS`, or a ``.py`` file."""
    if name in WORKLOADS:
        return importlib.import_module(WORKLOADS[name])
    spec = importlib.util.spec_from_file_location(
        f"pyloader_workload_{os.path.basename(name)[:-3]}", name)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a workload from {name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    """Parse ``WORKLOAD`` and its arguments, then serve one measurement."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not (argv[0] in WORKLOADS or argv[0].endswith(".py")):
        print(f"usage: python -m pyloader.compare.child {{{','.join(WORKLOADS)},FILE.py}} ...",
              file=sys.stderr)
        return 2
    name = argv[0]
    module = load_workload(name)
    p = argparse.ArgumentParser(prog=f"python -m pyloader.compare.child {name}",
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
