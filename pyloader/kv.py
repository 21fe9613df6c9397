"""A preallocated KV cache that speaks mlx-lm's cache protocol.

``make_kv_cache(model, max_context=N)`` returns the list of per-layer caches
``mlx_lm.generate`` / ``stream_generate`` expect as ``prompt_cache``. Every
layer that mlx-lm would give a growing ``KVCache`` gets one backed by a single
arena allocated up front (all layers' keys and values at ``max_context``
rounded up to 256 tokens, committed at once), so memory is flat from the first
token and a run that starts is a run that fits. New tokens are written into
the arena in place by a C++ MLX primitive: nothing is reallocated and the
history is never copied. Layers that keep other state (sliding-window
``RotatingKVCache``, linear-attention ``ArraysCache``, ...) keep the cache the
model itself asks for. ``kv_bits=8`` (or 4) stores keys and values quantized
with per-group scales, also preallocated, and mlx-lm's attention runs its
quantized path on them.

The classes are named like mlx-lm's (``KVCache``, ``QuantizedKVCache``) and
their ``state`` has the same layout, so ``mlx_lm.save_prompt_cache`` writes an
ordinary mlx-lm file: ``mlx_lm.load_prompt_cache`` reads it back as mlx-lm's
growing caches, and :func:`load_prompt_cache` reads it back preallocated.

See ``docs/kv-cache.md`` for the design and its ordering rules.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from ._native import _core

__all__ = [
    "KVCache",
    "KVCachePlan",
    "KVCacheWarning",
    "KVLayerPlan",
    "QuantizedKVCache",
    "load_prompt_cache",
    "make_kv_cache",
    "plan_kv_cache",
    "working_dtype",
]

#: Capacity granularity, as mlx-lm's KVCache.step.
STEP = 256


class KVCacheWarning(UserWarning):
    """Something about the KV cache the user should know: the context outgrew the
    preallocated arena, mlock was refused, or keys arrived in another dtype."""


# ----------------------------------------------------------------------------
# The model's working precision


def _promote(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """MLX's type promotion (lazy: nothing is computed)."""
    return (mx.zeros((), dtype=a) + mx.zeros((), dtype=b)).dtype


def working_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype a model's attention computes keys and values in, from
    its parameters alone.

    A quantized layer stores packed ``uint32`` weights, so ``weight.dtype`` of a
    projection is not it: a quantized layer's output has the dtype of its
    ``scales``. Keys are the key projection's output of the normed residual
    stream, which starts as the embedding's output, so the answer is MLX's
    promotion of the dtypes of the embedding, the norms and the key projections
    (``scales`` for quantized ones, ``weight`` otherwise). A checkpoint that
    keeps norms in float32 next to float16 scales (common in GGUF conversions)
    computes in float32. Never an integer type.
    """
    params = dict(tree_flatten(model.parameters()))
    floating = [n for n, p in params.items() if mx.issubdtype(p.dtype, mx.floating)]
    if not floating:
        raise ValueError("the model has no floating-point parameters to take a dtype from")

    def output_dtype(module: str) -> Optional[mx.Dtype]:
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
    if not dtypes:
        return params[floating[0]].dtype
    out = dtypes[0]
    for dt in dtypes[1:]:
        out = _promote(out, dt)
    return out


# ----------------------------------------------------------------------------
# Planning: which layers get the arena, and their shapes


@dataclass(frozen=True)
class KVLayerPlan:
    """One entry of the cache list."""

    path: tuple[int, ...]   # index in the cache list (and inside a CacheList)
    kind: str               # "KVCache", "QuantizedKVCache" (arena), or the kept class
    heads: int = 0          # key/value heads (arena layers)
    key_dim: int = 0
    value_dim: int = 0
    nbytes: int = 0         # arena bytes of this layer
    dtype: Optional[mx.Dtype] = None  # of keys and values (scales, when quantized)


@dataclass(frozen=True)
class KVCachePlan:
    """What :func:`make_kv_cache` allocates: ``nbytes`` is the whole arena (what the
    process's memory grows by, and then stays at)."""

    max_context: int
    capacity: int           # max_context rounded up to STEP
    batch_size: int
    dtype: mx.Dtype         # of keys and values (of most layers, if they differ)
    kv_bits: Optional[int]
    kv_group_size: int
    layers: tuple[KVLayerPlan, ...] = field(repr=False)
    nbytes: int = 0

    @property
    def arena_layers(self) -> int:
        return sum(1 for l in self.layers if l.nbytes)

    def summary(self) -> str:
        """One line: arena layers and bytes, and the layers that keep mlx-lm's caches."""
        kept = {}
        for l in self.layers:
            if not l.nbytes:
                kept[l.kind] = kept.get(l.kind, 0) + 1
        other = ", ".join(f"{n}× {k}" for k, n in kept.items())
        kind = f"{self.kv_bits}-bit" if self.kv_bits else str(self.dtype).split(".")[-1]
        return (f"KV arena: {self.arena_layers} layers × {self.capacity} tokens "
                f"({kind}, batch {self.batch_size}) = {self.nbytes / 2**20:.1f} MiB"
                + (f"; kept: {other}" if other else ""))


def _is_streamed(model: nn.Module) -> bool:
    """True for a pyloader streaming model (its streamed modules carry a unit)."""
    return any(hasattr(m, "_pyloader_unit") for _, m in model.named_modules())


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


def _attention_shapes(model: nn.Module, index: int) -> Optional[tuple[int, int, int]]:
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


def _probe_shapes(model: nn.Module, paths, batch_size: int) -> dict:
    """{path: (kv heads, key dim, value dim, dtype)} from running the model lazily
    on one token per row with recording caches: a graph is built and dropped,
    nothing is evaluated (unless the model itself evaluates something)."""
    caches = _base_caches(model)
    probes = {}
    for p in paths:
        probe = _ProbeCache()
        probes[p] = probe
        if len(p) == 1:
            caches[p[0]] = probe
        else:
            inner = list(caches[p[0]].caches)
            inner[p[1]] = probe
            caches[p[0]].caches = tuple(inner)
    model(mx.zeros((batch_size, 1), dtype=mx.int32), cache=caches)
    out = {}
    for p, probe in probes.items():
        if probe.seen is not None:
            (b, h, _, dk), (_, _, _, dv), dt = probe.seen
            out[p] = (h, dk, dv, dt)
    return out


def _round_up(n: int, step: int = STEP) -> int:
    return max(1, math.ceil(n / step)) * step


def _slot_specs(batch, heads, capacity, kdim, vdim, dtype, bits, group_size):
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


def _specs_nbytes(specs) -> int:
    return sum(math.prod(shape) * dt.size for shape, dt in specs)


def plan_kv_cache(model: nn.Module, max_context: int, dtype: Optional[mx.Dtype] = None,
                  kv_bits: Optional[int] = None, kv_group_size: int = 64,
                  batch_size: int = 1) -> KVCachePlan:
    """What :func:`make_kv_cache` would allocate for `model`, without allocating."""
    plan, _ = _plan(model, max_context, dtype, kv_bits, kv_group_size, batch_size)
    return plan


def _plan(model, max_context, dtype, kv_bits, kv_group_size, batch_size):
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
    # Shapes and dtypes from a lazy one-token forward pass (exact, and cheap:
    # nothing is evaluated). A streamed model would load every layer for it, so
    # there the attention modules' attributes and working_dtype() answer.
    found = {}
    if _is_streamed(model):
        if all(len(p) == 1 for p in paths) and len(caches) == len(getattr(model, "layers", ())):
            rule = working_dtype(model)
            found = {p: _attention_shapes(model, p[0]) for p in paths}
            found = {p: (*s, rule) for p, s in found.items() if s is not None}
    if len(found) < len(paths):
        found = _probe_shapes(model, paths, batch_size)
    capacity = _round_up(max_context)
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
            n = _specs_nbytes(_slot_specs(batch_size, h, capacity, dk, dv, dt, kv_bits,
                                          kv_group_size))
            layers.append(KVLayerPlan(p, kind, h, dk, dv, n, dt))
            total += n
    kinds = [l.dtype for l in layers if l.nbytes]
    chosen = dtype if dtype is not None else (
        max(set(kinds), key=kinds.count) if kinds else working_dtype(model))
    plan = KVCachePlan(max_context, capacity, batch_size, chosen, kv_bits, kv_group_size,
                       tuple(layers), total)
    return plan, caches


# ----------------------------------------------------------------------------
# Memory


def _available_memory() -> Optional[int]:
    """Bytes this process can still commit: MemAvailable, capped by the memory
    cgroup's headroom (v2 or v1), or None when unknown."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass

    def read_int(path):
        try:
            with open(path) as f:
                text = f.read().strip()
            return None if text == "max" else int(text)
        except (OSError, ValueError):
            return None

    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.strip().split(":", 2) for line in f if line.strip()]
    except OSError:
        entries = []
    for _, controllers, rel in entries:
        if controllers == "":  # v2
            base = "/sys/fs/cgroup" + rel
            limit, usage = read_int(base + "/memory.max"), read_int(base + "/memory.current")
        elif "memory" in controllers.split(","):
            base = "/sys/fs/cgroup/memory" + rel
            limit = read_int(base + "/memory.limit_in_bytes")
            usage = read_int(base + "/memory.usage_in_bytes")
        else:
            continue
        if limit is not None and usage is not None and limit < (1 << 60):
            found.append(max(0, limit - usage))
    return min(found) if found else None


def _create_arena(specs, populate: bool, lock: bool):
    if populate:
        need = _specs_nbytes(specs)
        avail = _available_memory()
        if avail is not None and need > avail:
            raise MemoryError(
                f"the KV cache needs {need / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB "
                "can be committed (MemAvailable / cgroup limit). Lower max_context, use "
                "kv_bits=8 (about half the memory), or pass populate=False not to commit it now.")
    arena = _core.KvArena.create(specs, populate=populate, lock=lock)
    if lock and not arena.locked:
        warnings.warn(arena.lock_error, KVCacheWarning, stacklevel=3)
    return arena


class _Group:
    """The arena shared by the caches of one make_kv_cache call, and the
    once-per-group warning flags. `layers` lists each cache's slots."""

    def __init__(self, specs, layers: list[list[int]], populate: bool, lock: bool,
                 cast_ok: bool = False):
        self.specs = specs
        self.cast_ok = cast_ok  # the user chose the dtype: casting is what they asked for
        self.layers = layers
        self.populate = populate
        self.lock = lock
        self.arena = _create_arena(specs, populate, lock)
        self.warned: set[str] = set()
        self._quantized: dict = {}

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, KVCacheWarning, stacklevel=4)

    def __deepcopy__(self, memo):
        return _Group(self.specs, self.layers, self.populate, self.lock, self.cast_ok)

    def quantized(self, slots: list[int], group_size: int, bits: int):
        """(group, slots) of the layer with `slots` in this group's layers converted
        to a quantized cache: one arena for all the floating layers, made on the
        first layer's to_quantized and shared by the others."""
        key = (group_size, bits)
        if key not in self._quantized:
            specs, layers, where = [], [], {}
            for old in self.layers:
                if len(old) != 2:
                    continue
                (kshape, dt), (vshape, _) = self.specs[old[0]], self.specs[old[1]]
                b, h, c, dk = kshape
                first = len(specs)
                specs += _slot_specs(b, h, c, dk, vshape[3], dt, bits, group_size)
                where[old[0]] = list(range(first, len(specs)))
                layers.append(where[old[0]])
            self._quantized[key] = (
                _Group(specs, layers, self.populate, self.lock, self.cast_ok), where)
        group, where = self._quantized[key]
        return group, where[slots[0]]


# ----------------------------------------------------------------------------
# The caches


class _ArenaCache:
    """What the arena caches share: writing, growth past the arena, and the
    protocol methods that do not depend on quantization."""

    step = STEP

    def __init__(self, group: _Group, slots: list[int]):
        self._group = group
        self._slots = slots
        self._seq = _core.KvSequence(group.arena, slots)
        self._dtypes = [group.specs[i][1] for i in slots]
        self.offset = 0
        self._written = False
        self._fallback = None  # mlx-lm cache after the context outgrew the arena

    # -- writing ---------------------------------------------------------------

    def _store(self, arrays):
        n = arrays[0].shape[2]
        if self.offset + n > self._seq.capacity:
            self._outgrow()
            return None
        for a, dt in zip(arrays, self._dtypes):
            if a.dtype != dt and not self._group.cast_ok:
                self._group.warn_once(
                    "dtype", f"the KV cache stores {dt} but the model produced {a.dtype}; "
                    f"values are cast (pass dtype={a.dtype} to make_kv_cache to keep them)")
        views = self._seq.write(list(arrays), self.offset)
        self.offset += n
        self._written = True
        return views

    def update_and_fetch(self, keys, values):
        if self._fallback is None:
            views = self._store((keys, values))
            if views is not None:
                return views[0], views[1]
        out = self._fallback.update_and_fetch(keys, values)
        self.offset = self._fallback.offset
        return out

    def _views(self):
        return self._seq.view(self.offset)

    def _outgrow(self) -> None:
        self._group.warn_once(
            "overflow",
            f"the context outgrew the preallocated KV cache ({self._seq.capacity} tokens); "
            "continuing with mlx-lm's growing cache, so memory is no longer preallocated. "
            "Pass a larger max_context to make_kv_cache.")
        fb = self._new_fallback()
        self._fill_fallback(fb)
        self._fallback = fb
        self._seq = None

    def _new_fallback(self):
        return mlx_cache.KVCache()

    def _fill_fallback(self, fb) -> None:
        if self._written:
            fb.keys, fb.values = self._views()
        fb.offset = self.offset

    # -- the rest of the protocol -----------------------------------------------

    @property
    def keys(self):
        if self._fallback is not None:
            return self._fallback.keys
        return self._views()[0] if self._written else None

    @property
    def values(self):
        if self._fallback is not None:
            return self._fallback.values
        return self._views()[1] if self._written else None

    @property
    def capacity(self) -> int:
        """Tokens the arena holds (0 after falling back to a growing cache)."""
        return self._seq.capacity if self._seq is not None else 0

    @property
    def preallocated(self) -> bool:
        return self._fallback is None

    @property
    def copy_on_write_count(self) -> int:
        """Writes redirected to a fresh arena because a live array still showed the
        positions being rewritten (after a trim); 0 in ordinary generation."""
        return self._seq.copy_on_write_count if self._seq is not None else 0

    def keys_and_values(self):
        return self.keys, self.values

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self._fallback.empty() if self._fallback is not None else not self._written

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: its share of the arena (its full capacity, like
        mlx-lm's KVCache reports its allocated buffers)."""
        return self._fallback.nbytes if self._fallback is not None else self._seq.nbytes

    @property
    def state(self):
        if self._fallback is not None:
            return self._fallback.state
        k, v = self._views() if self._written else (None, None)
        return k, v, self.offset

    @state.setter
    def state(self, v):
        keys, values, offset = v
        self._set_state((keys, values), offset)

    def _set_state(self, parts, offset: int) -> None:
        if self._fallback is not None or offset > self.capacity:
            if self._fallback is None:
                self._outgrow()
            self._fallback.state = self._fallback_state(parts, offset)
            self.offset = offset
            return
        self.offset = 0
        self._written = False
        if offset:
            arrays = [a[..., :offset, :] for a in self._flat(parts)]
            # Evaluated now, so that a later trim and rewrite (how prompt caches
            # are reused) finds no pending write and stays in place.
            mx.eval(self._store(arrays))

    def _fallback_state(self, parts, offset):
        return (*parts, offset)

    @staticmethod
    def _flat(parts):
        return list(parts)

    @property
    def meta_state(self):
        return (str(self.offset), str(self.capacity))

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v[0])

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if self._fallback is not None:
            n = self._fallback.trim(n)
            self.offset = self._fallback.offset
            return n
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return mlx_cache.create_attention_mask(*args, offset=self.offset, **kwargs)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        if self._fallback is not None:
            new._fallback = copy.deepcopy(self._fallback, memo)
            return new
        new._group = copy.deepcopy(self._group, memo)
        new._seq = _core.KvSequence(new._group.arena, self._slots)
        new.offset, new._written = 0, False
        if self._written:
            mx.eval(new._store(list(self._views())))  # run it now: see _set_state
        new.offset = self.offset
        return new

    def __repr__(self) -> str:
        where = (f"capacity={self.capacity}" if self._fallback is None
                 else "outgrown: mlx-lm growing cache")
        return f"pyloader.kv.{type(self).__name__}(offset={self.offset}, {where})"


class KVCache(_ArenaCache):
    """mlx-lm's ``KVCache`` protocol over a preallocated arena (see the module doc).

    Not built directly: use :func:`make_kv_cache`, :func:`load_prompt_cache` or
    :meth:`from_state`.
    """

    @classmethod
    def merge(cls, caches):
        """Batch several caches into mlx-lm's BatchKVCache (not preallocated)."""
        return mlx_cache.BatchKVCache.merge(caches)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKVCache":
        """A preallocated quantized cache holding this cache's tokens (what mlx-lm's
        generate calls for ``kv_bits``); the layers of one group share one new arena."""
        if self._fallback is not None:
            return self._fallback.to_quantized(group_size=group_size, bits=bits)
        group, slots = self._group.quantized(self._slots, group_size, bits)
        q = QuantizedKVCache(group, slots, group_size, bits)
        if self._written:
            k, v = self._views()
            q._store([*mx.quantize(k, group_size=group_size, bits=bits),
                      *mx.quantize(v, group_size=group_size, bits=bits)])
        return q

    @classmethod
    def from_state(cls, state, max_context: Optional[int] = None) -> "KVCache":
        """A preallocated cache holding `state` (mlx-lm's layout), with room for
        `max_context` tokens (default: the state's tokens, rounded up)."""
        return _adopt([_mlx_from_state(cls, state)], max_context)[0]


class QuantizedKVCache(_ArenaCache):
    """mlx-lm's ``QuantizedKVCache`` protocol over a preallocated arena: keys and
    values are stored as ``bits``-bit integers with per-group scales and biases,
    and (because it has ``bits``) mlx-lm's attention runs its quantized path."""

    def __init__(self, group: _Group, slots: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(group, slots)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys, values):
        """Quantize and store the new keys/values in place; return all cached so far."""
        if self._fallback is None:
            qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
            qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
            views = self._store([*qk, *qv])
            if views is not None:
                return tuple(views[:3]), tuple(views[3:])
        out = self._fallback.update_and_fetch(keys, values)
        self.offset = self._fallback.offset
        return out

    def _new_fallback(self):
        return mlx_cache.QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    def _fill_fallback(self, fb) -> None:
        if self._written:
            views = self._views()
            fb.keys, fb.values = tuple(views[:3]), tuple(views[3:])
        fb.offset = self.offset

    @property
    def keys(self):
        if self._fallback is not None:
            return self._fallback.keys
        return tuple(self._views()[:3]) if self._written else None

    @property
    def values(self):
        if self._fallback is not None:
            return self._fallback.values
        return tuple(self._views()[3:]) if self._written else None

    @property
    def state(self):
        if self._fallback is not None:
            return self._fallback.state
        k, v = (self.keys, self.values) if self._written else (None, None)
        return k, v, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v):
        keys, values, offset, group_size, bits = v
        if (group_size, bits) != (self.group_size, self.bits):
            raise ValueError(f"state is {bits}-bit with group size {group_size}; this cache "
                             f"is {self.bits}-bit with group size {self.group_size}")
        self._set_state((keys, values), offset)

    def _fallback_state(self, parts, offset):
        return (*parts, offset, self.group_size, self.bits)

    @staticmethod
    def _flat(parts):
        return [*parts[0], *parts[1]]

    @classmethod
    def from_state(cls, state, max_context: Optional[int] = None) -> "QuantizedKVCache":
        """A preallocated quantized cache holding `state` (mlx-lm's layout)."""
        return _adopt([_mlx_from_state(cls, state)], max_context)[0]

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", bits={self.bits}, group_size={self.group_size})"


# ----------------------------------------------------------------------------
# Entry points


def _check_device() -> None:
    if mx.default_device() != mx.cpu:
        raise RuntimeError(
            "pyloader's preallocated KV cache is host memory written by a CPU kernel; "
            f"the default device is {mx.default_device()}. Use mx.set_default_device(mx.cpu), "
            "or mlx-lm's own caches on the GPU.")


def make_kv_cache(model: nn.Module, max_context: int, dtype: Optional[mx.Dtype] = None,
                  kv_bits: Optional[int] = None, *, kv_group_size: int = 64,
                  batch_size: int = 1, lock: bool = False, populate: bool = True) -> list:
    """The model's prompt cache with every growing KV layer preallocated.

    Args:
        model: an mlx-lm model (anything with ``layers`` and, optionally,
            ``make_cache``).
        max_context: tokens to reserve per layer (prompt + generation); rounded
            up to a multiple of 256. A longer context keeps working: the cache then
            falls back to mlx-lm's growing cache with a :class:`KVCacheWarning`.
        dtype: the cache dtype; default: the model's working precision
            (:func:`working_dtype`: the ``scales`` dtype of a quantized model,
            never its packed ``uint32``).
        kv_bits: store keys and values quantized to 8 (or 4, ...) bits with
            per-group scales; attention runs mlx-lm's quantized path.
        kv_group_size: quantization group size (32, 64 or 128).
        batch_size: rows per forward pass.
        lock: ``mlock`` the arena; a :class:`KVCacheWarning` says why if the system
            refuses (e.g. ``RLIMIT_MEMLOCK``).
        populate: commit every page now (default). A cache that does not fit
            raises ``MemoryError`` here instead of failing mid-run. ``False`` maps
            it lazily (memory then grows as tokens arrive, without copies).

    Returns:
        A list for ``prompt_cache=``: :class:`KVCache` (or :class:`QuantizedKVCache`)
        for each growing KV layer, and the model's own cache for every other layer
        (sliding windows, linear-attention state).
    """
    _check_device()
    plan, caches = _plan(model, max_context, dtype, kv_bits, kv_group_size, batch_size)
    specs, owners = [], []
    for lp in plan.layers:
        if lp.nbytes:
            first = len(specs)
            specs += _slot_specs(batch_size, lp.heads, plan.capacity, lp.key_dim, lp.value_dim,
                                 lp.dtype, kv_bits, kv_group_size)
            owners.append((lp.path, list(range(first, len(specs)))))
    if not owners:
        return caches
    group = _Group(specs, [slots for _, slots in owners], populate, lock,
                   cast_ok=dtype is not None)
    for path, slots in owners:
        c = (KVCache(group, slots) if kv_bits is None
             else QuantizedKVCache(group, slots, kv_group_size, kv_bits))
        if len(path) == 1:
            caches[path[0]] = c
        else:
            inner = list(caches[path[0]].caches)
            inner[path[1]] = c
            caches[path[0]].caches = tuple(inner)
    return caches


def _mlx_from_state(cls, state):
    if issubclass(cls, QuantizedKVCache):
        return mlx_cache.QuantizedKVCache.from_state(state)
    return mlx_cache.KVCache.from_state(state)


def _adopt(caches: list, max_context: Optional[int], lock: bool = False,
           populate: bool = True) -> list:
    """Moves mlx-lm KVCache / QuantizedKVCache entries (with content) into one
    new arena; everything else is returned as is."""
    _check_device()
    todo = []
    for i, c in enumerate(caches):
        if type(c) in (mlx_cache.KVCache, mlx_cache.QuantizedKVCache) and c.keys is not None:
            todo.append(i)
    if not todo:
        return caches
    need = max(caches[i].offset for i in todo)
    capacity = _round_up(max(need, max_context or 0))
    specs, owners = [], []
    for i in todo:
        c = caches[i]
        first = len(specs)
        if isinstance(c, mlx_cache.QuantizedKVCache):
            k, v = c.keys, c.values
            b, h, _, _ = k[0].shape
            dk = k[0].shape[3] * 32 // c.bits
            dv = v[0].shape[3] * 32 // c.bits
            specs += _slot_specs(b, h, capacity, dk, dv, k[1].dtype, c.bits, c.group_size)
        else:
            b, h, _, dk = c.keys.shape
            specs += _slot_specs(b, h, capacity, dk, c.values.shape[3], c.keys.dtype, None, 0)
        owners.append((i, list(range(first, len(specs)))))
    group = _Group(specs, [slots for _, slots in owners], populate, lock)
    out = list(caches)
    for i, slots in owners:
        c = caches[i]
        if isinstance(c, mlx_cache.QuantizedKVCache):
            new = QuantizedKVCache(group, slots, c.group_size, c.bits)
            new.state = (c.keys, c.values, c.offset, c.group_size, c.bits)
        else:
            new = KVCache(group, slots)
            new.state = (c.keys, c.values, c.offset)
        out[i] = new
    return out


def load_prompt_cache(file_name: str, max_context: Optional[int] = None,
                      return_metadata: bool = False, *, lock: bool = False):
    """``mlx_lm.load_prompt_cache``, with the KV layers moved into a preallocated
    arena of `max_context` tokens (default: the saved tokens, rounded up to 256)."""
    caches, metadata = mlx_cache.load_prompt_cache(file_name, return_metadata=True)
    caches = _adopt(caches, max_context, lock)
    return (caches, metadata) if return_metadata else caches
