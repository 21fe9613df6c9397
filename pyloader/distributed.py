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

``resident="auto"`` sizes every rank from its own memory at load time: each rank's
weight budget is its headroom (the one rule, :func:`pyloader._util.memory.headroom_of`,
page cache counted as used) minus the pre-flight reserve, and :func:`gather_memory`
hands every rank's budget and least need to every rank (one ``all_gather``). A rank
that cannot fit makes every rank raise the same ``MemoryError`` before anything is
read (:func:`check_memory`). With ``shard="pipeline"`` and no ``split``,
``plan_split(path, "auto", group=g)`` chooses the split from the gathered budgets
(identical on every rank); each rank's resident set then follows its own budget
(:meth:`Share.auto_resident`). Under ``shard="tensor"`` every rank runs every layer in
lockstep and must stream the same layers (:func:`check_lockstep`): the budget is the
smallest rank's, applied to each rank's share (its slices and the replicated tensors).

``shard="tensor"`` applies mlx-lm's own tensor parallelism instead
(``model.shard(group)``, the call ``sharded_load(tensor_group=...)`` makes) and
reads only this rank's slice of every sharded tensor. Which slice that is is
learnt from mlx-lm itself, not re-implemented: :func:`trace_shard` gives every
parameter a lazy stand-in whose values are its indices along one axis (a
broadcast: nothing allocated), runs ``shard`` (on the model for axis 0 and on
structural clones for the other axes), and reads back which indices each sharded
parameter kept (materializing one parameter's traced slice at a time). A
parameter kept whole is read whole; a sharded one becomes a slice of its
checkpoint tensor (:meth:`pyloader.io.checkpoint.Checkpoint.with_slices`): a
block of rows is one byte range (a zero-copy view under mmap when aligned), a
block of columns one range per row, read into a fresh buffer. Streaming and
residency per rank work unchanged (units read their slices). Quantized layers
need nothing special: mlx's ``QuantizedAllToShardedLinear`` & co. cut weight,
scales and biases themselves, and each is traced like any other parameter.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ._native import core
from ._util.hooks import add_hook, attach_handle, get_hook, handle_of
from ._util.names import layer_of
from ._util.sizes import format_bytes, parse_bytes
from .io.checkpoint import Checkpoint, TensorMeta
from .io.pagecache import evict_file
from .io.readers import PreadReader
from .streaming import SourceMap, controller_of, placeholder
from .streaming.preflight import RESERVE, auto_budget

SHARD_MODES = ("pipeline", "tensor")

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
        mode: ``"pipeline"`` or ``"tensor"`` (every rank runs every layer, on its
            slice of each sharded parameter; ``split`` is then empty).
        split: Layers per rank (mlx-lm's convention: rank 0 runs the *last*
            ``split[0]`` layers, rank ``size - 1`` the first ones).
        start, end: This rank's layers ``[start, end)`` in checkpoint numbering
            (tensor: every layer).
        adapted: True when pyloader applied the pipeline protocol (llama,
            qwen3); False when mlx-lm's own ``pipeline`` did.
        resident: The rank's resident-set argument (from a per-rank list; with
            ``resident="auto"`` the byte budget it resolved to).
        slices: Tensor sharding: each sharded parameter → the slice this rank keeps.
        memory: ``resident="auto"``: every rank's gathered :class:`RankMemory`.
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
    slices: dict[str, ParamSlice] = field(default_factory=dict, repr=False)
    memory: list[RankMemory] = field(default_factory=list, repr=False)
    load_s: float = 0.0

    def restrict(self, model: nn.Module, sources: SourceMap, ckpt: Checkpoint
                 ) -> tuple[SourceMap, Checkpoint]:
        """Keeps the parameters this rank's model still has (renamed to its
        module paths); the tensors of other ranks' layers are dropped before
        anything is read. Tensor sharding: each sharded parameter's source
        becomes its slice, served by the returned checkpoint."""
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
        if self.slices:
            ckpt, out = self._sliced(ckpt, out)
        self.owned_tensors = sorted({t.name for t in out.values()})
        return SourceMap(direct=out), ckpt

    def auto_resident(self, direct: dict[str, TensorMeta], prefetch: int) -> str:
        """``resident="auto"`` for this rank's share (``direct``: the sources
        :meth:`restrict` returned): every rank's budget and least need gathered and
        checked (:func:`check_memory`: ``MemoryError`` on every rank when one cannot
        fit), then a ``resident=`` byte budget: under ``"pipeline"`` this rank's own;
        under ``"tensor"`` the smallest rank's, so that every rank streams the same
        layers (see :func:`check_lockstep`)."""
        layer_bytes, fixed = tensor_layer_bytes(direct.values())
        self.memory = gather_memory(self.group, least_need(layer_bytes, fixed, prefetch))
        check_memory(self.memory, f"a {self.mode} share")
        budget = (min(m.budget for m in self.memory) if self.mode == "tensor"
                  else self.memory[self.rank].budget)
        self.resident = f"{budget}B"
        return self.resident

    def _sliced(self, ckpt: Checkpoint, direct: dict[str, TensorMeta]
                ) -> tuple[Checkpoint, dict[str, TensorMeta]]:
        """The checkpoint serving this rank's slices, and ``direct`` with each
        sharded parameter's tensor replaced by its slice."""
        specs = {}
        for param, sl in self.slices.items():
            t = direct[param]
            if tuple(t.shape) != sl.shape:
                raise ValueError(
                    f"{t.file}: tensor {t.name!r} has shape {list(t.shape)} but parameter "
                    f"{param!r} had {list(sl.shape)} before sharding; a rank can only read "
                    "slices of tensors stored as the model holds them (convert the "
                    "checkpoint with mlx_lm.convert)")
            specs[sl.name(t.name)] = (t.name, sl.axis, sl.ranges)
        ckpt = ckpt.with_slices([(n, t, a, r) for n, (t, a, r) in specs.items()])
        return ckpt, {p: ckpt[self.slices[p].name(t.name)] if p in self.slices else t
                      for p, t in direct.items()}

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


def check_lockstep(mode: str, resident) -> None:
    """ValueError for per-rank ``resident`` values that differ under tensor sharding.

    A streamed layer evaluates its output when it ends (so its weights can go), and
    under ``"tensor"`` that output holds the layer's ``all_sum``s; a rank that keeps the
    layer resident evaluates them only when something needs them (a prompt's last layer:
    never), so ranks that stream different layers would run different collectives and
    hang. (Under ``"pipeline"`` the stage's communication runs outside the streamed unit,
    so each rank may stream its own layers.)"""
    if (mode == "tensor" and isinstance(resident, (list, tuple))
            and any(v != resident[0] for v in resident)):
        raise ValueError(f"resident={list(resident)}: with shard='tensor' every rank must "
                         "stream the same layers (their collectives run in lockstep); "
                         "pass one value for every rank, or 'auto' (the smallest rank's "
                         "budget)")


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
    """Applies pipeline or tensor sharding to a (lazily loaded) mlx-lm model in place.

    Args:
        model: The model from ``mlx_lm.utils.load_model(path, lazy=True)``.
        group: An ``mx.distributed.Group``.
        mode: ``"pipeline"`` or ``"tensor"`` (mlx-lm's ``model.shard(group)``; the
            share's ``slices`` say which part of each parameter this rank reads).
        split: Pipeline only: layers per rank (mlx-lm's convention, rank 0 runs the
            last layers), a :class:`SplitPlan`, or None for mlx-lm's even split.
    """
    if mode not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {mode!r}; expected one of {SHARD_MODES} "
                         "(one group is either pipeline- or tensor-sharded)")
    if mode == "tensor":
        return _shard_tensors(model, group, split)
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
# Tensor parallelism: mlx-lm's shard, and which slice of each parameter it keeps


@dataclass(frozen=True)
class ParamSlice:
    """The part of a parameter one rank keeps: along ``axis``, the indices
    ``[start, stop)`` of each range in turn (every other axis whole) of the
    parameter's pre-sharding ``shape``."""

    shape: tuple[int, ...]
    axis: int
    ranges: tuple[tuple[int, int], ...]

    def name(self, tensor: str) -> str:
        """The slice's name in the sliced checkpoint, e.g. ``w[1:0-64]``."""
        return f"{tensor}[{self.axis}:{','.join(f'{a}-{b}' for a, b in self.ranges)}]"


def _shard_tensors(model: nn.Module, group, split) -> Share:
    if split is not None:
        raise ValueError("split= is a pipeline setting; shard='tensor' gives every rank "
                         "every layer")
    if not hasattr(model, "shard"):
        raise ValueError(f"model type {getattr(model, 'model_type', type(model).__name__)!r} "
                         "does not implement mlx-lm's shard (tensor parallelism); "
                         "use shard='pipeline'")
    n_layers = len(getattr(model, "layers", []) or [])
    share = Share(rank=group.rank(), size=group.size(), mode="tensor", split=[], start=0,
                  end=n_layers, n_layers=n_layers, adapted=False, group=group)
    heads = _head_counts(model)
    share.slices = trace_shard(model, group)
    _check_heads(heads, _head_counts(model), group.size())
    return share


def _head_counts(model: nn.Module) -> dict[tuple[str, str], int]:
    """Every integer attribute of the model's modules that counts heads (``n_heads``,
    ``num_key_value_heads``, ...), by (module path, attribute)."""
    return {(path, k): v for path, m in model.named_modules() for k, v in vars(m).items()
            if "head" in k and isinstance(v, int) and not isinstance(v, bool)}


def _check_heads(before: dict[tuple[str, str], int], after: dict[tuple[str, str], int],
                 size: int) -> None:
    """ValueError, at load, when mlx-lm's shard divided a head count that the group size
    does not divide: each rank would hold a fraction of a head's rows and fail (or
    compute garbage) at the first token."""
    for key, n in before.items():
        if after.get(key, n) != n and n % size:
            path, attr = key
            counts = sorted({v for k, v in before.items() if after.get(k, v) != v})
            raise ValueError(
                f"shard='tensor' over {size} ranks: {path or 'the model'}.{attr} is {n}, "
                f"which {size} does not divide (heads not divisible by the group size: "
                f"each rank would get {n / size:g} heads). Use shard='pipeline', or a "
                f"group whose size divides every head count ({', '.join(map(str, counts))})")


def trace_shard(model: nn.Module, group) -> dict[str, ParamSlice]:
    """Runs ``model.shard(group)`` (mlx-lm's tensor parallelism) on `model` and returns,
    for each parameter it sharded, the slice this rank keeps.

    Every parameter is replaced by a lazy broadcast of its indices along one axis
    (uint16, or uint32 past 65536; nothing allocated), ``shard`` runs, and each
    sharded parameter's first line along that axis says which indices were kept;
    the lines at the other corners must agree (a product of per-axis selections)
    and hold distinct, in-range indices. Axis 0 is traced on
    `model` itself (left sharded, its parameters one-element stand-ins of their sharded
    shapes, to be loaded), the other axes on clones of its module tree. One sharded
    parameter's trace is materialized at a time (the rank's slice of it, 2 bytes an
    element: at most its bf16 bytes).

    Raises:
        ValueError: naming the parameter, when sharding added or dropped a
            parameter, changed a dtype, produced values that are not indices, or
            cut more than one axis of a parameter.
    """
    params = dict(tree_flatten(model.parameters()))
    shapes = {p: tuple(a.shape) for p, a in params.items()}
    dtypes = {p: a.dtype for p, a in params.items()}
    del params
    ndim = max((len(s) for s in shapes.values()), default=0)
    kept: dict[str, dict[int, list[int]]] = {p: {} for p in shapes}
    sharded: dict[str, tuple[int, ...]] = {}
    for axis in reversed(range(max(ndim, 1))):  # clones first, while model is unsharded
        m = model if axis == 0 else _clone(model)
        m.update(tree_unflatten([(p, _index_trace(s, axis)) for p, s in shapes.items()]))
        m.shard(group)
        after = dict(tree_flatten(m.parameters()))
        if set(after) != set(shapes):
            extra, gone = sorted(set(after) - set(shapes)), sorted(set(shapes) - set(after))
            raise ValueError(f"{type(model).__module__}.shard added {extra[:3]} / dropped "
                             f"{gone[:3]} parameters; pyloader follows shards that cut "
                             "existing parameters only")
        lines = {}
        for p, s in shapes.items():
            sharded[p] = tuple(after[p].shape)
            if axis < len(s):
                lines[p] = _corner_lines(p, s, after[p], axis)
        # Nothing but the lazy lines may keep a traced parameter: evaluated, a sharded
        # one is an index copy of the rank's slice, so only one of them at a time.
        if m is model:
            model.update(tree_unflatten([(p, placeholder(sharded[p], dtypes[p]))
                                         for p in shapes]))
        del m, after
        for p in list(lines):  # a line is a view of its shard: drop each once read
            kept[p][axis] = _kept_indices(p, shapes[p], lines.pop(p), axis)
    out = {}
    for p, s in shapes.items():
        cut = [a for a, idx in kept[p].items() if idx != list(range(s[a]))]
        expected = tuple(len(kept[p][a]) if a in cut else n for a, n in enumerate(s))
        if len(cut) > 1 or expected != sharded[p]:
            raise ValueError(f"parameter {p!r} {list(s)} is sharded to {list(sharded[p])}, "
                             "along more than one axis; pyloader reads blocks along one axis")
        if cut:
            out[p] = ParamSlice(shape=s, axis=cut[0], ranges=_runs(kept[p][cut[0]]))
    return out


def _index_dtype(n: int) -> mx.Dtype:
    """The narrowest type for indices below `n` (what one traced shard costs)."""
    return mx.uint16 if n <= 1 << 16 else mx.uint32


def _index_trace(shape: tuple[int, ...], axis: int) -> mx.array:
    """A lazy array of `shape` whose value at every position is its index along `axis`."""
    if axis >= len(shape):
        return mx.broadcast_to(mx.zeros((), dtype=mx.uint16), shape)
    line = mx.arange(shape[axis], dtype=_index_dtype(shape[axis]))
    return mx.broadcast_to(line.reshape([-1 if d == axis else 1 for d in range(len(shape))]),
                           shape)


def _not_a_selection(param: str, shape: tuple[int, ...], why: str) -> ValueError:
    return ValueError(f"parameter {param!r} {list(shape)}: mlx-lm's shard did not just "
                      f"select along axes ({why}); pyloader cannot read it as slices of "
                      "its tensor")


def _corner_lines(param: str, shape: tuple[int, ...], traced: mx.array, axis: int
                  ) -> list[mx.array]:
    """The lines along `axis` of `traced` (a parameter's trace after sharding) at each
    corner of the other axes, lazily."""
    if traced.dtype != _index_dtype(shape[axis]) or traced.ndim != len(shape):
        raise _not_a_selection(param, shape,
                               f"dtype {traced.dtype}, shape {list(traced.shape)}")
    if 0 in traced.shape:
        raise _not_a_selection(param, shape, "empty result")
    lines = []
    for corner in range(1 << (len(shape) - 1)):
        bits = iter(range(len(shape) - 1))
        idx = tuple(slice(None) if d == axis else
                    (traced.shape[d] - 1 if corner >> next(bits) & 1 else 0)
                    for d in range(len(shape)))
        lines.append(traced[idx])
    return lines


def _kept_indices(param: str, shape: tuple[int, ...], lines: list[mx.array], axis: int
                  ) -> list[int]:
    """The indices along `axis` a parameter kept, from its :func:`_corner_lines` (they
    must agree: a product of per-axis selections)."""
    def fail(why: str) -> ValueError:
        return _not_a_selection(param, shape, why)
    mx.eval(lines)
    first = lines[0].tolist()
    if any(line.tolist() != first for line in lines[1:]):
        raise fail("its values differ across the other axes")
    if len(set(first)) != len(first) or any(i >= shape[axis] for i in first):
        raise fail("repeated or out-of-range indices")
    return first


def _runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """Consecutive indices as ``[start, stop)`` ranges, in order."""
    out = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


def _clone(value):
    """A copy of a module tree (modules, lists, dicts) sharing its arrays: what
    ``shard`` replaces on the copy leaves the original untouched."""
    if isinstance(value, nn.Module):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _clone(v)
        return out
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


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
    #: The dtype of the hidden state crossing this stage boundary (agreed at the first
    #: forward pass; None before).
    wire_dtype: Any = None

    def __call__(self, module, call, x, *args, **kwargs):
        if self.recv_from is not None:
            if self.wire_dtype is None:
                self.wire_dtype = _WIRE_DTYPES[int(mx.distributed.recv(
                    (1,), mx.int32, self.recv_from, group=self.group, stream=mx.cpu).item())]
            # The previous stage's output, in its dtype: the embedding's dtype (x here)
            # may differ from a layer's (a float16 embedding, float32 norms), and a
            # receive sized by x would read the sent bytes as another type.
            x = mx.distributed.recv(x.shape, self.wire_dtype, self.recv_from,
                                    group=self.group)
        out = call(x, *args, **kwargs)
        if self.send_to is not None:
            if self.wire_dtype is None:
                # Once, before the first hidden state: the dtype the next stage receives.
                self.wire_dtype = out.dtype
                mx.eval(mx.distributed.send(mx.array([_WIRE_DTYPES.index(out.dtype)],
                                                     dtype=mx.int32),
                                            self.send_to, group=self.group, stream=mx.cpu))
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


_WIRE_DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.float64, mx.int32, mx.int64,
                mx.int16, mx.int8, mx.uint32, mx.uint64, mx.uint16, mx.uint8, mx.bool_,
                mx.complex64]


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
    counters (``reader``: tensors and bytes handed out, bytes copied/read); with
    ``shard="tensor"`` also ``tensor_parallel`` (:func:`slice_stats`); with
    ``resident="auto"`` also ``auto``: this rank's weight budget and every rank's
    gathered headroom, budget and least need."""
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
    st["mode"] = share.mode
    if share.memory:  # resident="auto": what every rank measured, and this rank's budget
        st["auto"] = {"budget": parse_bytes(share.resident),
                      "ranks": [{"rank": m.rank, "headroom": m.headroom, "budget": m.budget,
                                 "need": m.need} for m in share.memory]}
    if share.mode == "tensor":
        st["tensor_parallel"] = slice_stats(ctl.checkpoint, share.owned_tensors)
    return st


def slice_stats(ckpt: Checkpoint, names: Sequence[str]) -> dict[str, int]:
    """What reading ``names`` (tensors and slices of a sliced checkpoint) costs:
    ``whole_bytes`` (tensors read whole), ``sliced_bytes`` (slices), of which
    ``strided_bytes`` are blocks of columns read as ``strided_reads`` ranges (one per
    row, exactly their bytes) spanning ``strided_page_bytes`` of whole pages: what
    the page cache reads from disk for them at least (a row's range shares its pages
    with the other ranks' ranges when it is shorter than a page)."""
    page = core.page_size()  # the kernel's, or PYLOADER_PAGE_SIZE
    out = {"whole_bytes": 0, "sliced_bytes": 0, "strided_bytes": 0, "strided_reads": 0,
           "strided_page_bytes": 0}
    real = set(ckpt.keys())
    for n in names:
        t = ckpt[n]
        if n in real:
            out["whole_bytes"] += t.nbytes
            continue
        out["sliced_bytes"] += t.nbytes
        extents = ckpt.extents(n)
        if len(extents) > 1:
            out["strided_bytes"] += t.nbytes
            out["strided_reads"] += len(extents)
            pages = set()
            for off, length in extents:
                pages.update(range(off // page, (off + length - 1) // page + 1))
            out["strided_page_bytes"] += len(pages) * page
    return out


# ----------------------------------------------------------------------------
# Proposing a split


def checkpoint_layer_bytes(path_or_ckpt, n_layers: int | None = None
                           ) -> tuple[list[int], int]:
    """Bytes of each layer's tensors and of the non-layer tensors, from the
    checkpoint index (layer: :func:`pyloader._util.names.layer_of`)."""
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
    once several requests fill the pipeline). ``memory``: with
    ``plan_split(path, "auto", group=g)``, every rank's gathered :class:`RankMemory`."""

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


def plan_split(path, budgets: Sequence[int | str] | str, *, group=None, prefetch: int = 1,
               **kwargs) -> SplitPlan:
    """:func:`propose_split` for a checkpoint: per-layer bytes from its index.

    Args:
        budgets: One weight budget per rank, or ``"auto"``: every rank of ``group``
            measures its own (:func:`gather_memory`; a collective, so every rank must
            call it) and all get the same split, or the same ``MemoryError``
            (:func:`check_memory`) when a rank cannot hold the non-layer tensors and
            the streaming buffers (``prefetch`` + 1 of the largest layer).
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


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory as ``resident="auto"`` sees it (bytes).

    Attributes:
        rank: The rank.
        budget: Its weight budget: headroom (page cache counted as used, clamped by
            ``PYLOADER_HEADROOM``) minus the pre-flight reserve
            (:func:`pyloader.streaming.preflight.auto_budget`).
        need: The least weight memory its share needs: the non-layer tensors plus the
            streaming buffers (or every layer, when that is less).
    """

    rank: int
    budget: int
    need: int

    @property
    def headroom(self) -> int:
        return self.budget + RESERVE

    @property
    def fits(self) -> bool:
        return self.need <= self.budget


#: Sent in place of a budget by a rank without a memory probe.
_NO_PROBE = -(1 << 62)


def gather_memory(group, need: int) -> list[RankMemory]:
    """Every rank's :class:`RankMemory`, rank 0 first, the same list on every rank: one
    ``all_gather`` of (budget, need) over ``group``, which every rank must enter."""
    try:
        budget = auto_budget()
    except RuntimeError:
        budget = _NO_PROBE  # raised below, on every rank, after the collective
    rows = mx.distributed.all_gather(mx.array([[budget, need]], dtype=mx.int64),
                                     group=group, stream=mx.cpu).tolist()
    blind = [r for r, (b, _) in enumerate(rows) if b == _NO_PROBE]
    if blind:
        raise RuntimeError(f"rank {blind[0]}: resident='auto' needs a memory probe and "
                           "none is readable there (pass a byte budget per rank, e.g. "
                           "resident=['4GB', '6GB'])")
    return [RankMemory(r, int(b), int(n)) for r, (b, n) in enumerate(rows)]


def check_memory(memory: Sequence[RankMemory], what: str) -> None:
    """``MemoryError`` (the same on every rank, from the gathered values) naming the
    first rank whose least need exceeds its budget, and every rank's numbers; ``what``
    names the load (no path: each rank may read its own copy)."""
    short = [m for m in memory if not m.fits]
    if not short:
        return
    m = short[0]
    every = "; ".join(f"rank {x.rank}: needs {format_bytes(x.need + RESERVE)}, has "
                      f"{format_bytes(x.headroom)}" for x in memory)
    raise MemoryError(
        f"rank {m.rank}: {what} with resident='auto' needs at least "
        f"{format_bytes(m.need + RESERVE)} (non-layer weights and streaming buffers "
        f"{format_bytes(m.need)}, reserve {format_bytes(RESERVE)}) but its headroom is "
        f"{format_bytes(m.headroom)}; nothing was loaded on any rank ({every}). Free "
        "memory on that rank, use more ranks or a smaller (quantized) checkpoint.")


def least_need(layer_bytes: Sequence[int], fixed_bytes: int, prefetch: int) -> int:
    """The least weight memory a share can run in: its non-layer tensors plus either
    every layer (when that is less) or the streaming buffers (the unit computing and
    ``prefetch`` more, sized by the largest layer, as the controller budgets them)."""
    if not layer_bytes:
        return fixed_bytes
    return fixed_bytes + min(sum(layer_bytes), (prefetch + 1) * max(layer_bytes))


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
