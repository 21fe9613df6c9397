"""Planning a preallocated KV cache: the model's working dtype, which layers get the
arena and at which shapes (nothing is allocated here)."""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .._util.optional import mlx_lm_module
from ..streaming import streams

# mlx-lm is optional: imported when a cache is first built or planned.
mlx_cache = mlx_lm_module("mlx_lm.models.cache", "pyloader.kv")

STEP = 256


def _promote(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """MLX's type promotion (lazy: nothing is computed)."""
    return (mx.zeros((), dtype=a) + mx.zeros((), dtype=b)).dtype


def working_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype a model's attention computes keys and values in, from its
    parameters: MLX's promotion of the dtypes of the embedding, norms and key projections
    (``scales`` for quantized ones, never packed ``uint32``). Never an integer type."""
    params = dict(tree_flatten(model.parameters()))
    floating = [n for n, p in params.items() if mx.issubdtype(p.dtype, mx.floating)]
    if not floating:
        raise ValueError("the model has no floating-point parameters to take a dtype from")

    def output_dtype(module: str) -> mx.Dtype | None:
        for leaf in ("scales", "weight"):
            p = params.get(f"{module}.{leaf}")
            if p is not None and mx.issubdtype(p.dtype, mx.floating):
                return p.dtype
        return None

    modules = {n.rsplit(".", 1)[0] for n in params if "." in n}
    path = [m for m in sorted(modules)
            if "embed" in m.rsplit(".", 1)[-1] or "norm" in m.rsplit(".", 1)[-1]
            or m.endswith("k_proj")]
    dtypes = [dt for dt in map(output_dtype, path) if dt is not None]
    return functools.reduce(_promote, dtypes) if dtypes else params[floating[0]].dtype


@dataclass(frozen=True)
class KVLayerPlan:
    """One entry of the cache list."""

    path: tuple[int, ...]   # index in the cache list (and inside a CacheList)
    kind: str               # "KVCache", "QuantizedKVCache" (arena), or the kept class
    heads: int = 0          # key/value heads (arena layers)
    key_dim: int = 0
    value_dim: int = 0
    nbytes: int = 0         # arena bytes of this layer
    dtype: mx.Dtype | None = None  # of keys and values (scales, when quantized)


@dataclass(frozen=True)
class KVCachePlan:
    """What :func:`make_kv_cache` allocates: ``nbytes`` is the whole arena (what the
    process's memory grows by, and then stays at)."""

    max_context: int
    capacity: int           # max_context rounded up to STEP
    batch_size: int
    dtype: mx.Dtype         # of keys and values (of most layers, if they differ)
    kv_bits: int | None
    kv_group_size: int
    layers: tuple[KVLayerPlan, ...] = field(repr=False)
    nbytes: int = 0

    @property
    def arena_layers(self) -> int:
        return sum(1 for l in self.layers if l.nbytes)

    def summary(self) -> str:
        """One line: arena layers and bytes, and the layers that keep mlx-lm's caches."""
        kept = collections.Counter(lp.kind for lp in self.layers if not lp.nbytes)
        other = ", ".join(f"{n}× {k}" for k, n in kept.items())
        kind = f"{self.kv_bits}-bit" if self.kv_bits else str(self.dtype).split(".")[-1]
        return (f"KV arena: {self.arena_layers} layers × {self.capacity} tokens "
                f"({kind}, batch {self.batch_size}) = {self.nbytes / 2**20:.1f} MiB"
                + (f"; kept: {other}" if other else ""))


def _is_plain_kv(c: Any) -> bool:
    return type(c) is mlx_cache.KVCache


def _base_caches(model: nn.Module) -> list:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [mlx_cache.KVCache() for _ in model.layers]


def _kv_paths(caches: list) -> list[tuple[int, ...]]:
    paths = []
    for i, c in enumerate(caches):
        if _is_plain_kv(c):
            paths.append((i,))
        elif isinstance(c, mlx_cache.CacheList):
            paths += [(i, j) for j, s in enumerate(c.caches) if _is_plain_kv(s)]
    return paths


def _attention_shapes(model: nn.Module, index: int) -> tuple[int, int, int] | None:
    """(kv heads, key dim, value dim) of layer `index` from its attention module's
    attributes, or None when the layer does not look like the usual attention."""
    layers = getattr(model, "layers", None)
    if layers is None or index >= len(layers):
        return None
    layer = layers[index]
    attn = next((getattr(layer, a) for a in ("self_attn", "attention", "attn")
                 if isinstance(getattr(layer, a, None), nn.Module)), None)
    if attn is None:
        return None
    heads = next((getattr(attn, a) for a in ("n_kv_heads", "num_key_value_heads", "num_kv_heads")
                  if isinstance(getattr(attn, a, None), int)), None)
    k, v = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
    if not heads or k is None or v is None or not hasattr(k, "weight") or not hasattr(v, "weight"):
        return None
    kout, vout = k.weight.shape[0], v.weight.shape[0]
    if kout % heads or vout % heads:
        return None
    return heads, kout // heads, vout // heads


class _ProbeCache:
    """Records the shapes a layer's attention hands its cache; computes nothing."""

    offset = 0

    def __init__(self):
        self.seen = None

    def update_and_fetch(self, keys, values):
        self.seen = (keys.shape, values.shape, keys.dtype)
        return keys, values

    def make_mask(self, *args, **kwargs):
        return mlx_cache.create_attention_mask(*args, offset=0, **kwargs)

    @property
    def state(self):
        return []

    def empty(self):
        return True

    def size(self):
        return 0


def put_cache(caches: list, path: tuple[int, ...], cache: Any) -> None:
    """Put ``cache`` at ``path`` in a cache list: ``(i,)`` is entry ``i``, ``(i, j)`` the
    ``j``-th cache of the ``CacheList`` at entry ``i``."""
    if len(path) == 1:
        caches[path[0]] = cache
    else:
        inner = list(caches[path[0]].caches)
        inner[path[1]] = cache
        caches[path[0]].caches = tuple(inner)


def probe_shapes(model: nn.Module, paths, batch_size: int) -> dict:
    """{path: (kv heads, key dim, value dim, dtype)} from a lazy one-token forward
    pass with recording caches; nothing is evaluated."""
    caches = _base_caches(model)
    probes = {p: _ProbeCache() for p in paths}
    for p, probe in probes.items():
        put_cache(caches, p, probe)
    model(mx.zeros((batch_size, 1), dtype=mx.int32), cache=caches)
    out = {}
    for p, probe in probes.items():
        if probe.seen is not None:
            (b, h, _, dk), (_, _, _, dv), dt = probe.seen
            out[p] = (h, dk, dv, dt)
    return out


def round_up(n: int, step: int = STEP) -> int:
    """``n`` rounded up to a positive multiple of ``step``."""
    return max(1, math.ceil(n / step)) * step


def slot_specs(batch, heads, capacity, kdim, vdim, dtype, bits, group_size):
    """``(shape, dtype)`` of each arena slot of one layer: keys and values, or their
    packed values, scales and biases when quantized."""
    if bits is None:
        return [((batch, heads, capacity, kdim), dtype), ((batch, heads, capacity, vdim), dtype)]
    specs = []
    for d in (kdim, vdim):
        if d % group_size or (d * bits) % 32:
            raise ValueError(
                f"kv_bits={bits} needs head dims divisible by kv_group_size={group_size}; "
                f"this model has {d}. Try kv_group_size=32, or kv_bits=None.")
        specs += [((batch, heads, capacity, d * bits // 32), mx.uint32),
                  ((batch, heads, capacity, d // group_size), dtype),
                  ((batch, heads, capacity, d // group_size), dtype)]
    return specs


def specs_nbytes(specs) -> int:
    """Bytes of the slots ``specs``."""
    return sum(math.prod(shape) * dt.size for shape, dt in specs)


def plan_kv_cache(model: nn.Module, max_context: int, dtype: mx.Dtype | None = None,
                  kv_bits: int | None = None, kv_group_size: int = 64,
                  batch_size: int = 1) -> KVCachePlan:
    """What :func:`make_kv_cache` would allocate for `model`, without allocating."""
    return plan_caches(model, max_context, dtype, kv_bits, kv_group_size, batch_size)[0]


def plan_caches(model, max_context, dtype, kv_bits, kv_group_size, batch_size):
    """(the :class:`KVCachePlan`, the model's own cache list it was planned on)."""
    if not isinstance(max_context, int) or max_context < 1:
        raise ValueError(f"max_context must be a positive int, got {max_context!r}")
    if kv_bits not in (None, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"kv_bits must be None or one of 2, 3, 4, 5, 6, 8; got {kv_bits!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if dtype is not None and not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"the KV cache dtype must be floating, got {dtype}")
    caches = _base_caches(model)
    paths = _kv_paths(caches)
    # Shapes from a lazy one-token pass; a streamed model would load every layer for it,
    # so there the attention attributes and working_dtype() answer.
    found = {}
    if (streams(model) and all(len(p) == 1 for p in paths)
            and len(caches) == len(getattr(model, "layers", ()))):
        rule = working_dtype(model)
        found = {p: _attention_shapes(model, p[0]) for p in paths}
        found = {p: (*s, rule) for p, s in found.items() if s is not None}
    if len(found) < len(paths):
        found = probe_shapes(model, paths, batch_size)
    capacity = round_up(max_context)
    layers, total = [], 0
    kind = "KVCache" if kv_bits is None else "QuantizedKVCache"
    for i, c in enumerate(caches):
        inner = c.caches if isinstance(c, mlx_cache.CacheList) else None
        entries = [((i, j), s) for j, s in enumerate(inner)] if inner is not None else [((i,), c)]
        for p, sub in entries:
            s = found.get(p)
            if s is None:  # not a plain KVCache, or never called by the forward pass
                layers.append(KVLayerPlan(p, type(sub).__name__))
                continue
            h, dk, dv, dt = s
            dt = dtype if dtype is not None else dt
            n = specs_nbytes(slot_specs(batch_size, h, capacity, dk, dv, dt, kv_bits,
                                          kv_group_size))
            layers.append(KVLayerPlan(p, kind, h, dk, dv, n, dt))
            total += n
    kinds = [l.dtype for l in layers if l.nbytes]
    chosen = dtype if dtype is not None else (
        max(set(kinds), key=kinds.count) if kinds else working_dtype(model))
    return KVCachePlan(max_context, capacity, batch_size, chosen, kv_bits, kv_group_size,
                       tuple(layers), total), caches
