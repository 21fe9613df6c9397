"""Pipeline splits: mlx-lm's even split, and a proposed split that balances each rank's compute and
I/O for its memory budget (:func:`propose_split`, :func:`plan_split`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .._util.names import layer_of
from .._util.sizes import parse_bytes
from ..io.checkpoint import Checkpoint, TensorMeta
from ..io.pagecache import evict_file
from ..io.readers import PreadReader
from .memory import RankMemory, check_memory, gather_memory, least_need


def even_split(n_layers: int, size: int) -> list[int]:
    """mlx-lm's default split (``PipelineMixin``'s): even, low ranks get the extras."""
    base, extra = divmod(n_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def layer_range(split: Sequence[int], rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of `rank` under `split` (rank 0 runs the last)."""
    start = sum(split[rank + 1:])
    return start, start + split[rank]


def check_split(split: Sequence[int], n_layers: int, size: int) -> list[int]:
    """``split`` as ints; ValueError unless one positive entry per rank sums to ``n_layers``."""
    split = [int(s) for s in split]
    if len(split) != size:
        raise ValueError(f"split has {len(split)} entries for group size {size}")
    if any(s <= 0 for s in split) or sum(split) != n_layers:
        raise ValueError(f"split {split} must be positive and sum to {n_layers} layers")
    return split


def checkpoint_layer_bytes(path_or_ckpt, n_layers: int | None = None
                           ) -> tuple[list[int], int]:
    """Bytes of each layer's tensors and of the non-layer tensors, from the index."""
    ckpt = path_or_ckpt if isinstance(path_or_ckpt, Checkpoint) else Checkpoint(path_or_ckpt)
    return tensor_layer_bytes(ckpt.tensors(), n_layers)


def tensor_layer_bytes(tensors: Iterable[TensorMeta], n_layers: int | None = None
                       ) -> tuple[list[int], int]:
    """Bytes of each layer's tensors (or slices) among ``tensors``, and of the others."""
    per: dict[int, int] = {}
    fixed = 0
    for t in tensors:
        i = layer_of(t.name)
        if i is None:
            fixed += t.nbytes
        else:
            per[i] = per.get(i, 0) + t.nbytes
    n = n_layers if n_layers is not None else (max(per) + 1 if per else 0)
    # Layers past n (e.g. MTP layers past the model's last layer: sanitize drops them) are left out.
    return [per.get(i, 0) for i in range(n)], fixed


@dataclass
class RankPlan:
    """One rank's part of a :class:`SplitPlan` (all times per forward pass)."""

    rank: int
    layers: tuple[int, int]      # [start, end) in checkpoint numbering
    weight_bytes: int            # its layers + the non-layer tensors
    resident_bytes: int          # what fits its budget
    streamed_bytes: int          # read from disk on every pass
    compute_s: float
    io_s: float
    stage_s: float               # max(compute, io) with prefetch, else the sum


@dataclass
class SplitPlan:
    """A proposed pipeline split; ``split`` is what ``Distribution(group, split=...)`` takes."""

    split: list[int]
    ranks: list[RankPlan]
    pass_s: float
    bottleneck_s: float
    memory: list[RankMemory] = field(default_factory=list)  # budgets="auto": gathered

    def summary(self) -> str:
        lines = [(f"split {self.split}: {self.pass_s * 1e3:.2f} ms/pass, "
                  f"slowest stage {self.bottleneck_s * 1e3:.2f} ms")]
        for r in self.ranks:
            lines.append(
                f"  rank {r.rank}: layers [{r.layers[0]}, {r.layers[1]}), "
                f"{r.weight_bytes / 2**20:.1f} MiB, resident {r.resident_bytes / 2**20:.1f} MiB, "
                f"streamed {r.streamed_bytes / 2**20:.1f} MiB/pass, compute "
                f"{r.compute_s * 1e3:.2f} ms, io {r.io_s * 1e3:.2f} ms")
        return "\n".join(lines)


def _per_rank(value, size: int, what: str) -> list[float]:
    vals = list(value) if isinstance(value, (list, tuple)) else [value] * size
    if len(vals) != size:
        raise ValueError(f"{what}: {len(vals)} values for {size} ranks")
    if any(v <= 0 for v in vals):
        raise ValueError(f"{what} must be positive, got {vals}")
    return [float(v) for v in vals]


def propose_split(layer_bytes: Sequence[int], budgets: Sequence[int | str], *,
                  fixed_bytes: int = 0, read_bps: float | Sequence[float] = 1e9,
                  compute_bps: float | Sequence[float] = 1e10,
                  layer_flops: Sequence[float] | None = None,
                  prefetch: bool = True) -> SplitPlan:
    """The contiguous split of layers over ranks that balances compute and I/O.

    Args:
        layer_bytes: Bytes of each layer, in order (:func:`checkpoint_layer_bytes`).
        budgets: Weight-memory budget per rank, rank 0 first (bytes or ``"6GB"``).
        fixed_bytes: Non-layer bytes every rank keeps resident.
        read_bps: Disk read bandwidth in bytes/s (one value or one per rank).
        compute_bps: Weight bytes a rank processes per second in a forward pass.
        layer_flops: Optional relative cost of each layer (default: its bytes).
        prefetch: Whether streamed reads overlap compute.

    Raises:
        ValueError: a rank's budget is below ``fixed_bytes``, or fewer layers than ranks.
    """
    size = len(budgets)
    n = len(layer_bytes)
    if size < 1 or n < size:
        raise ValueError(f"cannot split {n} layers over {size} ranks")
    budget = [parse_bytes(b) if isinstance(b, str) else int(b) for b in budgets]
    for r, b in enumerate(budget):
        if b < fixed_bytes:
            raise ValueError(f"rank {r}: budget {b} bytes is below the {fixed_bytes} bytes "
                             "of non-layer tensors every rank keeps resident")
    read = _per_rank(read_bps, size, "read_bps")
    comp = _per_rank(compute_bps, size, "compute_bps")
    cost = list(layer_flops) if layer_flops is not None else [float(b) for b in layer_bytes]
    if len(cost) != n:
        raise ValueError(f"layer_flops has {len(cost)} entries for {n} layers")
    pre_b = [0, *itertools.accumulate(layer_bytes)]
    pre_c = [0.0, *itertools.accumulate(cost)]

    def stage(r: int, a: int, b: int) -> tuple[float, float, float, int, int]:
        room = budget[r] - fixed_bytes
        # The resident set is a prefix of the rank's layers (placement first_n).
        resident = 0
        for i in range(a, b):
            if resident + layer_bytes[i] > room:
                break
            resident += layer_bytes[i]
        streamed = pre_b[b] - pre_b[a] - resident
        c = (pre_c[b] - pre_c[a] + fixed_bytes) / comp[r]
        io = streamed / read[r]
        return (max(c, io) if prefetch else c + io), c, io, resident, streamed

    # Stages run first layers on rank size-1, ..., last layers on rank 0. best[k][i]: (bottleneck,
    # total) for layers [0, i) on the k ranks size-1 ... size-k, and the cut that achieved it.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(size + 1)]
    cut = [[0] * (n + 1) for _ in range(size + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, size + 1):
        r = size - k
        for i in range(k, n - (size - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                t = stage(r, j, i)[0]
                cand = (max(prev[0], t), prev[1] + t)
                if cand < best[k][i]:
                    best[k][i] = cand
                    cut[k][i] = j
    ranks, b = [], n  # rank 0 (k = size) holds the last layers
    for k in range(size, 0, -1):
        a = cut[k][b]
        t, c, io, resident, streamed = stage(size - k, a, b)
        ranks.append(RankPlan(rank=size - k, layers=(a, b),
                              weight_bytes=pre_b[b] - pre_b[a] + fixed_bytes,
                              resident_bytes=resident + fixed_bytes, streamed_bytes=streamed,
                              compute_s=c, io_s=io, stage_s=t))
        b = a
    return SplitPlan(split=[r.layers[1] - r.layers[0] for r in ranks], ranks=ranks,
                     pass_s=best[size][n][1], bottleneck_s=best[size][n][0])


def plan_split(path, budgets: Sequence[int | str] | str, *, group=None, prefetch: int = 1,
               **kwargs) -> SplitPlan:
    """:func:`propose_split` for a checkpoint: per-layer bytes from its index.

    Args:
        budgets: One weight budget per rank, or ``"auto"``: gathered from every rank of ``group``
            (a collective; the same split, or the same ``MemoryError``, on every rank).
        kwargs: :func:`propose_split`'s rates.
    """
    layer_bytes, fixed = checkpoint_layer_bytes(path)
    memory = []
    if isinstance(budgets, str) and budgets == "auto":
        if group is None:
            raise ValueError("plan_split(budgets='auto') gathers every rank's headroom: "
                             "pass group=")
        memory = gather_memory(group, least_need(layer_bytes, fixed, prefetch))
        check_memory(memory, "a pipeline split")
        budgets = [m.budget for m in memory]
    plan = propose_split(layer_bytes, budgets, fixed_bytes=fixed, **kwargs)
    plan.memory = memory
    return plan


def measure_read_bps(path, max_bytes: int = 256 << 20) -> float:
    """Cold read bandwidth (bytes/s) of a checkpoint here; evicts its files first."""
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    names, total = [], 0
    for t in sorted(ckpt.tensors(), key=lambda t: -t.nbytes):
        if total >= max_bytes:
            break
        names.append(t.name)
        total += t.nbytes
    for f in {t.file for t in ckpt.tensors()}:
        evict_file(f)
    t0 = time.perf_counter()
    mx.eval(list(PreadReader(ckpt, readahead=False, drop_cache=True).load(names).values()))
    return total / max(time.perf_counter() - t0, 1e-9)
