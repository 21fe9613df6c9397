"""Tensor parallelism: mlx-lm's ``shard``, and which slice of each parameter it keeps (learnt by
tracing indices through it, not re-implemented)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..streaming import placeholder


@dataclass(frozen=True)
class ParamSlice:
    """The part of a parameter one rank keeps: along ``axis``, the indices ``[start, stop)`` of each
    range in turn (every other axis whole) of the parameter's pre-sharding ``shape``."""

    shape: tuple[int, ...]
    axis: int
    ranges: tuple[tuple[int, int], ...]

    def name(self, tensor: str) -> str:
        """The slice's name in the sliced checkpoint, e.g. ``w[1:0-64]``."""
        return f"{tensor}[{self.axis}:{','.join(f'{a}-{b}' for a, b in self.ranges)}]"


def shard_and_trace(model: nn.Module, group) -> dict[str, ParamSlice]:
    """:func:`trace_shard`, with ValueError when the group size does not divide a head count."""
    heads = _head_counts(model)
    slices = trace_shard(model, group)
    _check_heads(heads, _head_counts(model), group.size())
    return slices


def _head_counts(model: nn.Module) -> dict[tuple[str, str], int]:
    """Every head-count attribute of the model's modules, by (module path, attribute)."""
    return {(path, k): v for path, m in model.named_modules() for k, v in vars(m).items()
            if "head" in k and isinstance(v, int) and not isinstance(v, bool)}


def _check_heads(before: dict[tuple[str, str], int], after: dict[tuple[str, str], int],
                 size: int) -> None:
    """ValueError when mlx-lm's shard divided a head count the group size does not divide."""
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
    """Runs ``model.shard(group)``; returns each sharded parameter's slice that this rank keeps.

    Raises:
        ValueError: naming the parameter, when sharding added or dropped one, changed a dtype,
            produced values that are not indices, or cut more than one axis.
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
        # Keep only the lazy lines: an evaluated traced parameter is a copy of the slice.
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
    """Lazily, the lines along ``axis`` of ``traced`` at each corner of the other axes."""
    if traced.dtype != _index_dtype(shape[axis]) or traced.ndim != len(shape):
        raise _not_a_selection(param, shape,
                               f"dtype {traced.dtype}, shape {list(traced.shape)}")
    if 0 in traced.shape:
        raise _not_a_selection(param, shape, "empty result")
    lines = []
    for corner in range(1 << (len(shape) - 1)):
        bits = iter(range(len(shape) - 1))
        lines.append(traced[tuple(slice(None) if d == axis else
                                  (traced.shape[d] - 1 if corner >> next(bits) & 1 else 0)
                                  for d in range(len(shape)))])
    return lines


def _kept_indices(param: str, shape: tuple[int, ...], lines: list[mx.array], axis: int
                  ) -> list[int]:
    """The indices along ``axis`` a parameter kept (its corner lines must agree)."""
    mx.eval(lines)
    first = lines[0].tolist()
    if any(line.tolist() != first for line in lines[1:]):
        raise _not_a_selection(param, shape, "its values differ across the other axes")
    if len(set(first)) != len(first) or any(i >= shape[axis] for i in first):
        raise _not_a_selection(param, shape, "repeated or out-of-range indices")
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
    """A copy of a module tree sharing its arrays, so ``shard`` leaves the original untouched."""
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
