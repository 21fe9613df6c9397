"""The ``first_use`` workload: load a checkpoint with ONE strategy, then use every tensor
once, in file order, the way a consumer does: nothing is evaluated in between, so a lazy
or overlapped load's reads run beside the use (``bench/first_use.py``).

Strategies (:data:`STRATEGIES`): ``mlx`` (``mx.load``, lazy arrays), ``pread`` and
``mmap`` (``pyloader.load``: every byte in on return / views), ``pread-overlap`` and
``mmap-overlap`` (``overlap=True``).

Timings (seconds, from the moment ``go`` arrived):

* ``t_return``: until the load call returned its dict;
* ``t_first``: until the first tensor (in file order) had been used;
* ``t_all``: until every tensor had been used. A use is ``mx.eval`` of a max over an
  unsigned-int view of the tensor (reads every byte), one tensor at a time.
"""

from __future__ import annotations

import argparse
import os
import time

import mlx.core as mx

from pyloader.io.checkpoint import Checkpoint
from pyloader.io.strategies import load_with_stats

#: name → (pyloader strategy or "mlx", overlap)
STRATEGIES = {
    "mlx": ("mlx", False),
    "pread": ("pread", False),
    "pread-overlap": ("pread", True),
    "mmap": ("mmap", False),
    "mmap-overlap": ("mmap", True),
}
UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint (file or directory)")
    p.add_argument("--strategy", required=True, choices=sorted(STRATEGIES))
    p.add_argument("--threads", type=int, default=None, help="pread reader threads")


def prepare(args: argparse.Namespace) -> tuple[dict, dict]:
    ckpt = Checkpoint(args.path)
    files = list(ckpt.files)
    # File order: (file, offset) of each tensor.
    rank = {f: i for i, f in enumerate(files)}
    order = [t.name for t in sorted(ckpt.tensors(), key=lambda t: (rank[t.file], t.offset))]
    state = {"files": files, "order": order, "bytes": ckpt.total_nbytes}
    del ckpt
    mx.eval(mx.max(mx.zeros((16,), dtype=mx.uint16)))  # start MLX's CPU stream now
    ready = {"pid": os.getpid(), "files": files, "bytes": state["bytes"],
             "tensors": len(order)}
    return ready, state


def _load(args: argparse.Namespace, files: list[str]) -> dict:
    strategy, overlap = STRATEGIES[args.strategy]
    if strategy == "mlx":
        arrays = {}
        for f in files:
            arrays.update(mx.load(f))  # lazy: nothing read yet
        return arrays
    arrays, _ = load_with_stats(args.path, strategy, threads=args.threads, overlap=overlap)
    return arrays


def run(args: argparse.Namespace, state: dict) -> dict:
    """Load, then use each tensor once in file order (arrays kept in ``state``)."""
    t0 = time.perf_counter()
    arrays = _load(args, state["files"])
    state["arrays"] = arrays
    t_return = time.perf_counter() - t0
    t_first = None
    for name in state["order"]:
        a = arrays[name]
        if a.size:
            mx.eval(mx.max(a.view(UINT[a.itemsize])))
        if t_first is None:
            t_first = time.perf_counter() - t0
    t_all = time.perf_counter() - t0
    return {"strategy": args.strategy, "path": args.path, "bytes": state["bytes"],
            "tensors": len(state["order"]), "t_return": t_return,
            "t_first": t_first if t_first is not None else t_all, "t_all": t_all}
