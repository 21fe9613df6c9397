"""A preallocated KV cache that speaks mlx-lm's cache protocol.

:func:`make_kv_cache` returns mlx-lm's ``prompt_cache`` list with every growing KV layer
backed by one arena allocated up front and written in place (no reallocation, no copies of
the history); other layers keep the model's own caches. ``state`` has mlx-lm's layout, so
prompt-cache files interoperate. See docs/kv-cache.md.
"""

from __future__ import annotations

import copy
import warnings

import mlx.core as mx
import mlx.nn as nn

from .._native import core
from .._util.memory import headroom_of, read_memory
from .._util.optional import mlx_lm_module
from ..errors import KVCacheWarning
from .plan import STEP, plan_caches, put_cache, round_up, slot_specs, specs_nbytes

# mlx-lm is optional: imported when a cache is first built or planned.
mlx_cache = mlx_lm_module("mlx_lm.models.cache", "pyloader.kv")


def _create_arena(specs, populate: bool, lock: bool):
    if populate:
        need = specs_nbytes(specs)
        avail = headroom_of(read_memory(), page_cache="used")
        if avail is not None and need > avail:
            raise MemoryError(
                f"the KV cache needs {need / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB "
                "can be committed (MemAvailable / cgroup limit). Lower max_context, use "
                "kv_bits=8 (about half the memory), or pass populate=False not to commit it now.")
    arena = core.KvArena.create(specs, populate=populate, lock=lock)
    if lock and not arena.locked:
        warnings.warn(arena.lock_error, KVCacheWarning, stacklevel=3)
    return arena


class ArenaGroup:
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
        return ArenaGroup(self.specs, self.layers, self.populate, self.lock, self.cast_ok)

    def quantized(self, slots: list[int], group_size: int, bits: int):
        """(group, slots) of layer ``slots`` converted to a quantized cache; one
        arena for all the group's layers, made on the first conversion and shared."""
        key = (group_size, bits)
        if key not in self._quantized:
            def layer(old):
                (kshape, dt), (vshape, _) = self.specs[old[0]], self.specs[old[1]]
                return old[0], slot_specs(*kshape, vshape[3], dt, bits, group_size)

            specs, owners = _pack(layer(old) for old in self.layers if len(old) == 2)
            self._quantized[key] = (ArenaGroup(specs, [s for _, s in owners], self.populate,
                                               self.lock, self.cast_ok), dict(owners))
        group, where = self._quantized[key]
        return group, where[slots[0]]


class _ArenaCache:
    """Shared by the arena caches: writing, growth past the arena, the protocol."""

    step = STEP

    def __init__(self, group: ArenaGroup, slots: list[int]):
        self._group = group
        self._slots = slots
        self._seq = core.KvSequence(group.arena, slots)
        self._dtypes = [group.specs[i][1] for i in slots]
        self.offset = 0
        self._written = False
        self._fallback = None  # mlx-lm cache after the context outgrew the arena

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

    def _encode(self, keys, values) -> list:
        """The arrays stored for new keys and values."""
        return [keys, values]

    def _split(self, views):
        """``(keys, values)`` from the stored arrays."""
        return views[0], views[1]

    def update_and_fetch(self, keys, values):
        if self._fallback is None:
            views = self._store(self._encode(keys, values))
            if views is not None:
                return self._split(views)
        out = self._fallback.update_and_fetch(keys, values)
        self.offset = self._fallback.offset
        return out

    def _views(self):
        return self._split(self._seq.view(self.offset))

    def _outgrow(self) -> None:
        self._group.warn_once(
            "overflow",
            f"the context outgrew the preallocated KV cache ({self._seq.capacity} tokens); "
            "continuing with mlx-lm's growing cache, so memory is no longer preallocated. "
            "Pass a larger max_context to make_kv_cache.")
        fb = self._new_fallback()
        if self._written:
            fb.keys, fb.values = self._views()
        fb.offset = self.offset
        self._fallback, self._seq = fb, None

    def _new_fallback(self):
        return mlx_cache.KVCache()

    def _part(self, i: int, name: str):
        if self._fallback is not None:
            return getattr(self._fallback, name)
        return self._views()[i] if self._written else None

    keys = property(lambda self: self._part(0, "keys"))
    values = property(lambda self: self._part(1, "values"))

    @property
    def capacity(self) -> int:
        """Tokens the arena holds (0 after falling back to a growing cache)."""
        return self._seq.capacity if self._seq is not None else 0

    @property
    def preallocated(self) -> bool:
        return self._fallback is None

    @property
    def copy_on_write_count(self) -> int:
        """Writes redirected to a fresh arena because a live array
        still showed the rewritten positions (after a trim); 0 in ordinary generation."""
        return self._seq.copy_on_write_count if self._seq is not None else 0

    def keys_and_values(self):
        return self.keys, self.values

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self._fallback.empty() if self._fallback is not None else not self._written

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: its full arena share (as mlx-lm's KVCache)."""
        return self._fallback.nbytes if self._fallback is not None else self._seq.nbytes

    @property
    def state(self):
        if self._fallback is not None:
            return self._fallback.state
        return self._fallback_state(self._views() if self._written else (None, None),
                                    self.offset)

    @state.setter
    def state(self, v):
        self._check_state(v)
        self._set_state(v[:2], v[2])

    def _check_state(self, v) -> None:
        """ValueError for a state this cache cannot take."""

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
            # stored now: a later trim and rewrite finds no pending write
            mx.eval(self._store([a[..., :offset, :] for a in self._flat(parts)]))

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
        new._seq = core.KvSequence(new._group.arena, self._slots)
        new.offset, new._written = 0, False
        if self._written:
            mx.eval(new._store(self._flat(self._views())))  # now: see _set_state
        new.offset = self.offset
        return new

    @classmethod
    def from_state(cls, state, max_context: int | None = None):
        """A preallocated cache of this class holding `state` (mlx-lm's layout), with room
        for `max_context` tokens (default: the state's tokens, rounded up)."""
        mlx_class = (mlx_cache.QuantizedKVCache if issubclass(cls, QuantizedKVCache)
                     else mlx_cache.KVCache)
        return _adopt([mlx_class.from_state(state)], max_context)[0]

    def __repr__(self) -> str:
        where = (f"capacity={self.capacity}" if self._fallback is None
                 else "outgrown: mlx-lm growing cache")
        return f"pyloader.kv.{type(self).__name__}(offset={self.offset}, {where})"


class KVCache(_ArenaCache):
    """mlx-lm's ``KVCache`` protocol over a preallocated arena. Build with
    :func:`make_kv_cache`, :func:`load_prompt_cache` or :meth:`from_state`."""

    @classmethod
    def merge(cls, caches):
        """Batch several caches into mlx-lm's BatchKVCache (not preallocated)."""
        return mlx_cache.BatchKVCache.merge(caches)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKVCache":
        """A preallocated quantized cache holding this cache's tokens; the layers
        of one group share one new arena."""
        if self._fallback is not None:
            return self._fallback.to_quantized(group_size=group_size, bits=bits)
        group, slots = self._group.quantized(self._slots, group_size, bits)
        q = QuantizedKVCache(group, slots, group_size, bits)
        if self._written:
            q._store(q._encode(*self._views()))
        return q


class QuantizedKVCache(_ArenaCache):
    """mlx-lm's ``QuantizedKVCache`` protocol over a preallocated arena:
    ``bits``-bit keys/values with per-group scales and biases (mlx-lm's quantized attention)."""

    def __init__(self, group: ArenaGroup, slots: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(group, slots)
        self.group_size = group_size
        self.bits = bits

    def _encode(self, keys, values) -> list:
        return [*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                *mx.quantize(values, group_size=self.group_size, bits=self.bits)]

    def _split(self, views):
        return tuple(views[:3]), tuple(views[3:])

    def _new_fallback(self):
        return mlx_cache.QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    def _check_state(self, v) -> None:
        group_size, bits = v[3:]
        if (group_size, bits) != (self.group_size, self.bits):
            raise ValueError(f"state is {bits}-bit with group size {group_size}; this cache "
                             f"is {self.bits}-bit with group size {self.group_size}")

    def _fallback_state(self, parts, offset):
        return (*parts, offset, self.group_size, self.bits)

    @staticmethod
    def _flat(parts):
        return [*parts[0], *parts[1]]

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", bits={self.bits}, group_size={self.group_size})"


def make_kv_cache(model: nn.Module, max_context: int, dtype: mx.Dtype | None = None,
                  kv_bits: int | None = None, *, kv_group_size: int = 64,
                  batch_size: int = 1, lock: bool = False, populate: bool = True) -> list:
    """The model's prompt cache with every growing KV layer preallocated.

    Args:
        model: an mlx-lm model (``layers`` and optionally ``make_cache``).
        max_context: tokens reserved per layer, rounded up to a multiple of 256. Past it the
            cache falls back to mlx-lm's growing cache with a :class:`KVCacheWarning`.
        dtype: default: :func:`working_dtype`.
        kv_bits: store keys and values quantized to this many bits.
        kv_group_size: quantization group size (32, 64 or 128).
        batch_size: rows per forward pass.
        lock: ``mlock`` the arena (a :class:`KVCacheWarning` if refused).
        populate: commit every page now, so a cache that does not fit raises ``MemoryError``
            here; ``False`` maps it lazily.

    Returns:
        A list for ``prompt_cache=``: :class:`KVCache` (or :class:`QuantizedKVCache`) per
        growing KV layer, the model's own cache for every other layer.
    """
    plan, caches = plan_caches(model, max_context, dtype, kv_bits, kv_group_size, batch_size)
    specs, owners = _pack((lp.path, slot_specs(batch_size, lp.heads, plan.capacity, lp.key_dim,
                                               lp.value_dim, lp.dtype, kv_bits, kv_group_size))
                          for lp in plan.layers if lp.nbytes)
    if not owners:
        return caches
    group = ArenaGroup(specs, [slots for _, slots in owners], populate, lock,
                       cast_ok=dtype is not None)
    for path, slots in owners:
        put_cache(caches, path, KVCache(group, slots) if kv_bits is None
                  else QuantizedKVCache(group, slots, kv_group_size, kv_bits))
    return caches


def _pack(layers) -> tuple[list, list]:
    """``(specs, [(key, slots)])`` of ``(key, slot specs)`` pairs laid out back to back."""
    specs, owners = [], []
    for key, layer in layers:
        owners.append((key, list(range(len(specs), len(specs) + len(layer)))))
        specs += layer
    return specs, owners


def _adopt(caches: list, max_context: int | None, lock: bool = False,
           populate: bool = True) -> list:
    """Moves mlx-lm KVCache / QuantizedKVCache entries into one new arena; the rest
    is returned as is."""
    todo = [i for i, c in enumerate(caches)
            if type(c) in (mlx_cache.KVCache, mlx_cache.QuantizedKVCache) and c.keys is not None]
    if not todo:
        return caches
    capacity = round_up(max(max(caches[i].offset for i in todo), max_context or 0))

    def layer_specs(c):
        if not isinstance(c, mlx_cache.QuantizedKVCache):
            b, h, _, dk = c.keys.shape
            return slot_specs(b, h, capacity, dk, c.values.shape[3], c.keys.dtype, None, 0)
        (k, scales, _), v = c.keys, c.values
        return slot_specs(*k.shape[:2], capacity, k.shape[3] * 32 // c.bits,
                          v[0].shape[3] * 32 // c.bits, scales.dtype, c.bits, c.group_size)

    specs, owners = _pack((i, layer_specs(caches[i])) for i in todo)
    group = ArenaGroup(specs, [slots for _, slots in owners], populate, lock)
    out = list(caches)
    for i, slots in owners:
        c = caches[i]
        q = isinstance(c, mlx_cache.QuantizedKVCache)
        new = QuantizedKVCache(group, slots, c.group_size, c.bits) if q else KVCache(group, slots)
        new.state = (c.keys, c.values, c.offset, *((c.group_size, c.bits) if q else ()))
        out[i] = new
    return out


def load_prompt_cache(file_name: str, max_context: int | None = None,
                      return_metadata: bool = False, *, lock: bool = False):
    """``mlx_lm.load_prompt_cache``, with the KV layers moved into a preallocated
    arena of `max_context` tokens (default: the saved tokens, rounded up to 256)."""
    caches, metadata = mlx_cache.load_prompt_cache(file_name, return_metadata=True)
    caches = _adopt(caches, max_context, lock)
    return (caches, metadata) if return_metadata else caches
