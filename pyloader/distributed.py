"""Loading across the ranks of an MLX distributed run.

``pyloader.load_model(path, group=mx.distributed.init())`` applies mlx-lm's
own pipeline sharding to the model (``model.model.pipeline(group, split)``,
the call ``mlx_lm.utils.sharded_load`` makes), and only then decides what to
read: each rank maps or streams the tensors of its own layers plus the
non-layer ones every stage keeps (embeddings, final norm, head), with its own
resident set and budget. Nothing of another rank's layers is requested from
the reader (``rank_stats(model)`` carries the reader's byte counters to check).

mlx-lm 0.32.2 implements ``pipeline`` on some architectures (qwen2, qwen3_5,
qwen3_moe, qwen3_next, deepseek, glm4_moe, ...) but not on llama or qwen3. For
those two, whose forward pass is "embed, every layer in ``model.layers``,
norm", :func:`shard_model` applies the same protocol as mlx-lm's
``PipelineMixin``: the same split rule (rank 0 runs the last layers), the
rank's first layer receives the hidden state from rank + 1
(``mx.distributed.recv_like``), its last layer sends to rank - 1 and
``all_gather`` hands rank 0's output to every rank, so every rank computes the
same logits.

:func:`propose_split` proposes the layers per rank from per-layer bytes, each
rank's budget, its read bandwidth and compute rate (the input a memory planner
can call); :func:`plan_split` does it for a checkpoint.

Tensor parallelism (``model.shard(group)``) is not handled here: it needs
slices of tensors, which the readers do not serve yet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ._util.hooks import add_hook, attach_handle, get_hook, handle_of
from ._util.names import layer_of
from ._util.sizes import parse_bytes
from .io.checkpoint import Checkpoint
from .io.pagecache import evict_file
from .io.readers import PreadReader
from .streaming import SourceMap, controller_of

SHARD_MODES = ("pipeline",)

# Architectures without mlx-lm's ``pipeline`` whose inner model runs exactly
# "embed -> for layer in self.layers -> norm" (read in mlx-lm 0.32.2), so the
# PipelineMixin protocol can be applied around their first and last layers.
_ADAPTED = ("llama", "qwen3")


# ----------------------------------------------------------------------------
# The rank's share


@dataclass
class Share:
    """What one rank owns.

    Attributes:
        rank, size: The rank in the group and the group size.
        mode: ``"pipeline"``.
        split: Layers per rank (mlx-lm's convention: rank 0 runs the *last*
            ``split[0]`` layers, rank ``size - 1`` the first ones).
        start, end: This rank's layers ``[start, end)`` in checkpoint numbering.
        adapted: True when pyloader applied the pipeline protocol (llama,
            qwen3); False when mlx-lm's own ``pipeline`` did.
        resident: The rank's resident-set argument (from a per-rank list).
    """

    rank: int
    size: int
    mode: str
    split: list[int]
    start: int
    end: int
    n_layers: int
    adapted: bool
    resident: Any = None
    group: Any = field(default=None, repr=False)
    renames: dict[str, str | None] = field(default_factory=dict, repr=False)
    owned_tensors: list[str] = field(default_factory=list, repr=False)
    load_s: float = 0.0

    def restrict(self, model: nn.Module, sources: SourceMap) -> SourceMap:
        """Keeps the parameters this rank's model still has (renamed to its
        module paths); the tensors of other ranks' layers are dropped before
        anything is read."""
        have = {k for k, _ in tree_flatten(model.parameters())}
        out = {}
        for param, t in sources.direct.items():
            param = self._rename(param)
            if param in have:
                out[param] = t
        kept_derived = {self._rename(p) for p in sources.derived} & have
        if kept_derived:
            raise ValueError(
                f"{len(kept_derived)} parameters (e.g. {next(iter(kept_derived))!r}) are "
                "computed by the model's sanitize from several tensors; a rank cannot "
                "compute them from its own tensors only. Convert the checkpoint with "
                "mlx_lm.convert first (as mlx_lm.utils.sharded_load requires).")
        missing = have - set(out)
        if missing:
            raise ValueError(f"rank {self.rank}: the checkpoint has no tensor for "
                             f"{sorted(missing)[:3]} ({len(missing)} parameters)")
        self.owned_tensors = sorted({t.name for t in out.values()})
        return SourceMap(direct=out)

    def _rename(self, param: str) -> str | None:
        """The parameter's path in this rank's model; None for another rank's
        layer (adapted pipelines renumber the rank's layers from 0)."""
        for old, new in self.renames.items():
            if param.startswith(old):
                return None if new is None else new + param[len(old):]
        return param

    def finish(self, model: nn.Module) -> None:
        """Records the share in the model's handle and synchronizes the ranks once
        loading is done (as sharded_load does, so a slow rank does not time out a fast
        one's first receive)."""
        attach_handle(model).share = self
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=self.group))


def even_split(n_layers: int, size: int) -> list[int]:
    """mlx-lm's default split: as even as possible, low ranks get the extra
    layers (the same rule as ``PipelineMixin.pipeline``)."""
    base, extra = divmod(n_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def layer_range(split: Sequence[int], rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of `rank` under `split` (rank 0 runs the last)."""
    start = sum(split[rank + 1:])
    return start, start + split[rank]


def _check_split(split: Sequence[int], n_layers: int, size: int) -> list[int]:
    split = [int(s) for s in split]
    if len(split) != size:
        raise ValueError(f"split has {len(split)} entries for group size {size}")
    if any(s <= 0 for s in split) or sum(split) != n_layers:
        raise ValueError(f"split {split} must be positive and sum to {n_layers} layers")
    return split


def rank_value(value, rank: int, size: int):
    """`value` itself, or its `rank`-th entry when it is a list/tuple with one
    value per rank (e.g. ``resident=["2GB", "6GB"]``)."""
    if isinstance(value, (list, tuple)):
        if len(value) != size:
            raise ValueError(f"{len(value)} per-rank values for a group of {size} ranks")
        return value[rank]
    return value


def shard_model(model: nn.Module, group, *, mode: str = "pipeline",
                split: Sequence[int] | SplitPlan | None = None) -> Share:
    """Applies pipeline sharding to a (lazily loaded) mlx-lm model in place.

    Args:
        model: The model from ``mlx_lm.utils.load_model(path, lazy=True)``.
        group: An ``mx.distributed.Group``.
        mode: ``"pipeline"``.
        split: Layers per rank (mlx-lm's convention, rank 0 runs the last
            layers), a :class:`SplitPlan`, or None for mlx-lm's even split.
    """
    if mode not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {mode!r}; expected one of {SHARD_MODES} "
                         "(tensor parallelism: mlx_lm.utils.sharded_load(tensor_group=...))")
    rank, size = group.rank(), group.size()
    if isinstance(split, SplitPlan):
        split = split.split
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__module__}: no model.model.layers to split")
    n_layers = len(layers)
    split = _check_split(split if split is not None else even_split(n_layers, size),
                         n_layers, size)
    start, end = layer_range(split, rank)
    share = Share(rank=rank, size=size, mode=mode, split=split, start=start, end=end,
                  n_layers=n_layers, adapted=False, group=group)
    if hasattr(inner, "pipeline"):
        inner.pipeline(group, split=split)
        if (inner.start_idx, inner.end_idx) != (start, end):
            raise RuntimeError(f"mlx-lm's pipeline gave layers [{inner.start_idx}, "
                               f"{inner.end_idx}), expected [{start}, {end})")
        return share
    model_type = getattr(model, "model_type", None)
    if model_type not in _ADAPTED:
        raise ValueError(f"model type {model_type!r} does not implement mlx-lm's pipeline "
                         f"and has no adapter here (adapted: {', '.join(_ADAPTED)})")
    share.adapted = True
    paths = {id(m): name for name, m in model.named_modules()}
    own = list(layers[start:end])
    old = [paths[id(m)] for m in own]
    dropped = [paths[id(m)] for i, m in enumerate(layers) if not start <= i < end]
    inner.layers = own
    paths = {id(m): name for name, m in model.named_modules()}
    # Old path -> new path (None: another rank's layer). Longest prefixes
    # first is not needed: every key ends with "." and layer paths differ.
    share.renames = {o + ".": paths[id(m)] + "." for o, m in zip(old, own)}
    share.renames.update({d + ".": None for d in dropped})
    if model_type == "llama":
        # Indices into the layer (and cache) list, computed for all layers.
        sliding = [getattr(m, "use_sliding", False) for m in own]
        inner.fa_idx = sliding.index(False) if False in sliding else 0
        inner.swa_idx = sliding.index(True) if True in sliding else None
    if size > 1:
        first, last = _stage(own[0]), _stage(own[-1])
        first.group = last.group = group
        first.recv_from = rank + 1 if rank < size - 1 else None
        last.send_to = rank - 1 if rank > 0 else None
        last.gather = group
    return share


# ----------------------------------------------------------------------------
# The pipeline protocol around a stage's first and last layer (adapted archs)


@dataclass
class StageHook:
    """The ``"pipeline"`` hook of a rank's first and last layer: receive the hidden state
    from the next rank, send the output to the previous one, gather rank 0's output."""

    group: Any = None
    recv_from: int | None = None
    send_to: int | None = None
    gather: Any = None

    def __call__(self, module, call, x, *args, **kwargs):
        if self.recv_from is not None:
            x = mx.distributed.recv_like(x, self.recv_from, group=self.group)
        out = call(x, *args, **kwargs)
        if self.send_to is not None:
            out = mx.distributed.send(out, self.send_to, group=self.group)
            # As mlx-lm's pipelined models do: the cache depends on the send, so
            # evaluating the cache state also completes the send.
            cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
            if cache is not None and hasattr(cache, "keys") and cache.keys is not None:
                cache.keys = mx.depends(cache.keys, out)
        if self.gather is not None:
            # Every rank gets rank 0's output (the end of the pipeline).
            out = mx.distributed.all_gather(out, group=self.gather)[: out.shape[0]]
        return out


def _stage(layer: nn.Module) -> StageHook:
    hook = get_hook(layer, "pipeline")
    if hook is None:
        hook = StageHook()
        add_hook(layer, "pipeline", hook)
    return hook


# ----------------------------------------------------------------------------
# Per-rank reporting


def rank_stats(model: nn.Module) -> dict[str, Any]:
    """``pyloader.stats(model)`` plus this rank's share and the reader's byte
    counters (``reader``: tensors and bytes handed out, bytes copied/read)."""
    h = handle_of(model)
    share = h.share if h is not None else None
    if share is None:
        raise ValueError("this model was not loaded by pyloader.load_model(group=...)")
    ctl = controller_of(model)
    st = ctl.stats()
    st["rank"] = share.rank
    st["size"] = share.size
    st["layers"] = [share.start, share.end]
    st["split"] = list(share.split)
    st["adapted_pipeline"] = share.adapted
    st["owned_tensors"] = len(share.owned_tensors)
    st["owned_bytes"] = sum(ctl.checkpoint[n].nbytes for n in share.owned_tensors)
    return st


# ----------------------------------------------------------------------------
# Proposing a split


def checkpoint_layer_bytes(path_or_ckpt, n_layers: int | None = None
                           ) -> tuple[list[int], int]:
    """Bytes of each layer's tensors and of the non-layer tensors, from the
    checkpoint index (layer: :func:`pyloader._util.names.layer_of`)."""
    ckpt = path_or_ckpt if isinstance(path_or_ckpt, Checkpoint) else Checkpoint(path_or_ckpt)
    per: dict[int, int] = {}
    fixed = 0
    for t in ckpt.tensors():
        i = layer_of(t.name)
        if i is None:
            fixed += t.nbytes
        else:
            per[i] = per.get(i, 0) + t.nbytes
    n = n_layers if n_layers is not None else (max(per) + 1 if per else 0)
    extra = [i for i in per if i >= n]
    if extra:  # e.g. MTP layers past the model's last layer: sanitize drops them
        for i in extra:
            del per[i]
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
    """A proposed pipeline split. ``split`` is what ``load_model(split=...)``
    and mlx-lm's ``pipeline(group, split)`` take (rank 0 runs the last layers).

    ``pass_s`` is one forward pass through every stage in turn (batch-1
    decode latency); ``bottleneck_s`` the slowest stage (the throughput limit
    once several requests fill the pipeline)."""

    split: list[int]
    ranks: list[RankPlan]
    pass_s: float
    bottleneck_s: float

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

    Each rank keeps the non-layer tensors (``fixed_bytes``) and as many of its
    layers as its budget holds resident; the rest of its layers are read from
    disk on every forward pass at its ``read_bps``. Its compute time is its
    layers' weight bytes over ``compute_bps`` (batch-1 decode reads every
    weight once: memory-bound), or ``layer_flops`` scaled the same way when
    given. A stage takes max(compute, io) with prefetch (I/O overlaps compute),
    their sum without.

    The split minimizes the slowest stage (the pipeline's throughput), then the
    total pass time (batch-1 latency), over every contiguous split (dynamic
    programming, O(ranks x layers^2)). With equal ranks and budgets that hold
    every layer it is the even split.

    Args:
        layer_bytes: Bytes of each layer, in order (:func:`checkpoint_layer_bytes`).
        budgets: Weight-memory budget per rank, rank 0 first (bytes or ``"6GB"``).
        fixed_bytes: Non-layer bytes every rank keeps resident.
        read_bps: Disk read bandwidth in bytes/s (one value or one per rank).
        compute_bps: Weight bytes a rank processes per second in a forward pass.
        layer_flops: Optional relative cost of each layer (default: its bytes).
        prefetch: Whether streamed reads overlap compute.

    Returns:
        A :class:`SplitPlan`. Raises ValueError when a rank's budget is below
        ``fixed_bytes`` or there are fewer layers than ranks.
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
    pre_b = [0]
    pre_c = [0.0]
    for b, c in zip(layer_bytes, cost):
        pre_b.append(pre_b[-1] + b)
        pre_c.append(pre_c[-1] + c)

    def stage(r: int, a: int, b: int) -> tuple[float, float, float, int, int]:
        nbytes = pre_b[b] - pre_b[a]
        room = budget[r] - fixed_bytes
        # The resident set is a prefix of the rank's layers (placement first_n).
        resident = 0
        for i in range(a, b):
            if resident + layer_bytes[i] > room:
                break
            resident += layer_bytes[i]
        streamed = nbytes - resident
        c = (pre_c[b] - pre_c[a] + fixed_bytes) / comp[r]
        io = streamed / read[r]
        return (max(c, io) if prefetch else c + io), c, io, resident, streamed

    # Stages run first layers on rank size-1, ..., last layers on rank 0.
    # best[k][i]: (bottleneck, total) for layers [0, i) on the k ranks
    # size-1 ... size-k, and the cut that achieved it.
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
    bounds = []
    i = n
    for k in range(size, 0, -1):
        j = cut[k][i]
        bounds.append((size - k, j, i))
        i = j
    ranks = []
    split = [0] * size
    for r, a, b in sorted(bounds):
        t, c, io, resident, streamed = stage(r, a, b)
        split[r] = b - a
        ranks.append(RankPlan(rank=r, layers=(a, b), weight_bytes=pre_b[b] - pre_b[a] + fixed_bytes,
                              resident_bytes=resident + fixed_bytes, streamed_bytes=streamed,
                              compute_s=c, io_s=io, stage_s=t))
    return SplitPlan(split=split, ranks=ranks, pass_s=best[size][n][1],
                     bottleneck_s=best[size][n][0])


def plan_split(path, budgets: Sequence[int | str], **kwargs) -> SplitPlan:
    """:func:`propose_split` for a checkpoint: per-layer bytes from its index."""
    layer_bytes, fixed = checkpoint_layer_bytes(path)
    return propose_split(layer_bytes, budgets, fixed_bytes=fixed, **kwargs)


def measure_read_bps(path, max_bytes: int = 256 << 20) -> float:
    """Cold read bandwidth of a checkpoint on this machine (bytes/s): evicts
    its files from the page cache and reads up to `max_bytes` of tensors."""
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
    arrays = PreadReader(ckpt, readahead=False, drop_cache=True).load(names)
    mx.eval(list(arrays.values()))
    return total / max(time.perf_counter() - t0, 1e-9)
