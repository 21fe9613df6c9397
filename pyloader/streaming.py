"""Layer streaming for mlx-lm models.

``load_model`` returns the ordinary mlx-lm model object for a checkpoint, in
which a chosen set of layers is *resident* (loaded once) and the rest are
*streamed*: each streamed unit (a layer, or with ``granularity="sublayer"``
each of its attention and MLP blocks) is brought in just before it runs and
released right after, while the next units are prefetched in the background.

How a unit is hooked: its module's class is swapped for a subclass whose
``__call__`` wraps the original (``isinstance`` and every attribute stay as
they were), so mlx-lm's generate, batch_generate, prompt caches and
speculative decoding drive the model unchanged. A model with every layer
resident has no hooked module at all: it is exactly the mlx-lm model.

Sources:

* ``strategy="mmap"``: aligned tensors of streamed units stay attached as
  zero-copy views of the file mapping; they cost memory only while their
  pages are mapped. Prefetch maps the next units' pages on a C++ worker
  (``MADV_POPULATE_READ``); release drops the unit's pages from the process
  (``MADV_DONTNEED``) and, unless ``keep_page_cache``, from the page cache.
  Misaligned tensors are copied in at load and dropped at release.
* ``strategy="pread"``: a streamed unit's tensors are read into fresh MLX
  buffers (prefetch = a background read on a C++ worker, optionally through
  io_uring) and dropped at release.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ._hooks import call_hook_class
from .budget import parse_bytes
from .checkpoint import Checkpoint
from .loaders import MmapReader, PreadReader

log = logging.getLogger(__name__)

PLACEMENTS = ("first_n", "last_n", "interleaved")
GRANULARITIES = ("layer", "sublayer")


# ----------------------------------------------------------------------------
# Resident set selection


def choose_resident(layer_bytes: list[int], resident, placement: str,
                    fixed_bytes: int = 0, stream_buffer: int = 0) -> set[int]:
    """Indices of the layers to keep resident.

    Args:
        layer_bytes: Bytes of each layer's weights, in order.
        resident: An int (layer count), a float in [0, 1] (fraction of the
            layers), a byte budget (a str like ``"600MB"``) for all weights in
            memory at once — ``fixed_bytes`` (non-layer weights, always resident)
            is spent first, then, unless every layer fits, ``stream_buffer`` (the
            streamed units in flight), then resident layers — or an explicit set
            (or list/tuple) of layer indices
            (as chosen by :func:`pyloader.residency.plan`; ``placement`` is then unused).
        placement: ``"first_n"``, ``"last_n"`` or ``"interleaved"``.
    """
    n_layers = len(layer_bytes)
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
    order = list(range(n_layers))
    if placement == "last_n":
        order.reverse()
    elif placement == "interleaved":
        order = _interleaved_order(n_layers)

    if isinstance(resident, (set, frozenset, list, tuple)):
        chosen = set(resident)
        bad = [i for i in chosen if not isinstance(i, int) or not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"resident layer indices {sorted(map(str, bad))} are not in "
                             f"range({n_layers})")
        return chosen
    if isinstance(resident, bool):
        raise TypeError("resident must be an int, a float in [0, 1] or a byte budget string")
    if isinstance(resident, int):
        if not 0 <= resident <= n_layers:
            raise ValueError(f"resident={resident} layers, but the model has {n_layers}")
        count = resident
    elif isinstance(resident, float):
        if not 0.0 <= resident <= 1.0:
            raise ValueError(f"resident fraction must be in [0, 1], got {resident}")
        count = round(resident * n_layers)
    elif isinstance(resident, str):
        budget = parse_bytes(resident) - fixed_bytes
        if sum(layer_bytes) > budget:
            budget -= stream_buffer  # something streams: its buffers come first
        count = 0
        for i in order:
            if budget < layer_bytes[i]:
                break
            budget -= layer_bytes[i]
            count += 1
    else:
        raise TypeError("resident must be an int, a float in [0, 1] or a byte budget string")
    return set(order[:count])


def _interleaved_order(n: int) -> list[int]:
    """An order whose every prefix of length k is spread evenly over range(n)."""
    order: list[int] = []
    seen: set[int] = set()
    k = 1
    while len(order) < n:
        for j in range(k):
            i = min(n - 1, (2 * j + 1) * n // (2 * k))
            if i not in seen:
                seen.add(i)
                order.append(i)
        k *= 2
    return order


# ----------------------------------------------------------------------------
# Units and their stats


@dataclass
class UnitStats:
    """Counters of one streamed unit."""

    loads: int = 0
    bytes_read: int = 0
    wait_s: float = 0.0     # time the forward pass waited for this unit's data
    compute_s: float = 0.0  # time in the synchronizing eval after the unit ran
    prefetched: int = 0     # loads whose data was requested ahead of time


@dataclass
class _Unit:
    name: str                      # module path, e.g. "model.layers.3.mlp"
    module: nn.Module
    order: int                     # execution order among streamed units
    params: dict[str, str]         # local parameter path -> source tensor name
    nbytes: int
    copied: list[str] = field(default_factory=list)  # local paths loaded per use
    stats: UnitStats = field(default_factory=UnitStats)


def _placeholder(shape, dtype) -> mx.array:
    """A stand-in of the right shape and dtype that costs one element even
    if something evaluates it."""
    return mx.broadcast_to(mx.zeros((), dtype=dtype), shape)


def _streamed_call(self, *args, **kwargs):
    unit = self._pyloader_unit
    ctl = unit.controller
    ctl.before(unit, args, kwargs)
    try:
        out = self._pyloader_base.__call__(self, *args, **kwargs)
        ctl.after(unit, out, args, kwargs)
    except BaseException:
        ctl.release(unit)
        ctl.drain()  # an error or Ctrl-C: no prefetch outlives it
        raise
    return out


_STREAMED_CLASSES: dict[type, type] = {}


def _streamed_class(cls: type) -> type:
    return call_hook_class(cls, "Streamed", _streamed_call, "_pyloader_base", _STREAMED_CLASSES)


class StreamingController:
    """Brings streamed units in before they run and releases them after."""

    def __init__(self, ckpt: Checkpoint, strategy: str, prefetch: int,
                 keep_page_cache: bool, read_backend: str):
        self.ckpt = ckpt
        self.strategy = strategy
        self.depth = prefetch
        self.keep_page_cache = keep_page_cache
        self.units: list[_Unit] = []
        self.mmap = MmapReader(ckpt) if strategy == "mmap" else None
        self.pread = (PreadReader(ckpt, backend=read_backend, readahead=False,
                                  drop_cache=not keep_page_cache)
                      if strategy == "pread" else None)
        self._tickets: dict[int, int] = {}
        self.passes = 0
        self.resident_bytes = 0
        self.derived_bytes = 0
        self.load_s = 0.0

    # -- the per-unit protocol ------------------------------------------------

    def _names(self, unit: _Unit, which: Iterable[str]) -> list[str]:
        return [unit.params[p] for p in which]

    def _attach(self, unit: _Unit, arrays: dict[str, mx.array], local: Iterable[str]) -> None:
        pairs = [(p, arrays[unit.params[p]]) for p in local]
        unit.module.update(tree_unflatten(pairs))

    def before(self, unit: _Unit, args=(), kwargs=None) -> None:
        """Bring ``unit``'s weights in (waiting for its prefetch) and schedule the next.

        The unit's inputs are evaluated asynchronously first, so the resident layers
        that ran lazily since the previous streamed unit compute while this one's
        read finishes (instead of after it)."""
        try:
            inputs = [a for a in list(args) + list((kwargs or {}).values())
                      if isinstance(a, mx.array)]
            if inputs:
                mx.async_eval(inputs)
            self._before(unit)
        except BaseException:
            # An I/O error or an interrupt: no prefetch may outlive it (a
            # failed one would fail the next pass too, a finished one holds
            # memory).
            self.drain()
            raise

    def _before(self, unit: _Unit) -> None:
        if unit.order == 0:
            self.passes += 1
        t0 = time.perf_counter()
        ticket = self._tickets.pop(unit.order, None)
        st = unit.stats
        if self.pread is not None:
            names = self._names(unit, unit.params)
            arrays = self.pread.take(ticket) if ticket is not None else self.pread.load(names)
            self._attach(unit, arrays, unit.params)
            st.bytes_read += unit.nbytes
        else:
            # Resident views and this unit's pages come from the mapping: a
            # truncated or rewritten file raises OSError here, before any of
            # them is touched (docs/RELIABILITY.md).
            self.mmap.check_unchanged()
            # Without a prefetch in flight, map the unit's pages now: an I/O
            # error then surfaces here as OSError instead of a fault mid-compute.
            if ticket is None:
                ticket_now = self.mmap.prefetch(self._names(unit, unit.params), "populate")
                self.mmap.wait(ticket_now)
            else:
                self.mmap.wait(ticket)
            if unit.copied:
                arrays = self.mmap.load(self._names(unit, unit.copied))
                self._attach(unit, arrays, unit.copied)
            st.bytes_read += unit.nbytes
        st.loads += 1
        st.prefetched += ticket is not None
        st.wait_s += time.perf_counter() - t0
        self._schedule(unit.order, len(self.units) - 1)

    def _schedule(self, current: int, limit: int) -> None:
        """Requests the next ``min(depth, limit)`` streamed units after ``current``
        (in execution order, wrapping into the next forward pass)."""
        n = len(self.units)
        for step in range(1, min(self.depth, limit) + 1):
            j = (current + step) % n
            if j in self._tickets:
                continue
            u = self.units[j]
            names = self._names(u, u.params)
            if self.pread is not None:
                self._tickets[j] = self.pread.submit(names)
            else:
                self._tickets[j] = self.mmap.prefetch(names, "populate")

    def after(self, unit: _Unit, out, args, kwargs) -> None:
        """Evaluate what reads ``unit``'s weights (output, cache state), then release it."""
        t0 = time.perf_counter()
        # The unit's weights may be released only once everything that reads
        # them has run: its output and the cache state it wrote.
        pending = [out]
        for a in list(args) + list(kwargs.values()):
            if hasattr(a, "state") and not isinstance(a, mx.array):
                pending.append(a.state)
        mx.eval([x for _, x in tree_flatten(pending) if isinstance(x, mx.array)])
        unit.stats.compute_s += time.perf_counter() - t0
        if self.mmap is not None:
            self.mmap.check_unchanged()  # changed under this unit's compute
        self.release(unit)
        # With no more streamed units than the prefetch depth, this unit is among
        # the next ones to run (next pass): request it again now that it is out, so
        # its read overlaps the rest of the pass instead of stalling it.
        self._schedule(unit.order, len(self.units))

    def release(self, unit: _Unit) -> None:
        """Drop ``unit``'s weights from this process (and the page cache unless kept)."""
        if self.pread is not None:
            drop = list(unit.params)
        else:
            drop = unit.copied
            for name in self._names(unit, unit.params):
                self.mmap.advise(name, "dontneed")
                if not self.keep_page_cache:
                    self.mmap.advise(name, "evict")
        if drop:
            current = dict(tree_flatten(unit.module.parameters()))
            unit.module.update(tree_unflatten(
                [(p, _placeholder(current[p].shape, current[p].dtype)) for p in drop]))

    def close(self) -> None:
        """Cancel outstanding prefetches (their buffers are freed)."""
        reader = self.pread if self.pread is not None else self.mmap
        for ticket in self._tickets.values():
            reader.cancel(ticket)
        self._tickets.clear()

    def drain(self) -> None:
        """Cancel queued prefetches and wait out (discarding their result or
        error) the one already running, so the queue is empty."""
        tickets, self._tickets = list(self._tickets.values()), {}
        for ticket in tickets:
            if self.pread is not None:
                if not self.pread.cancel(ticket):
                    try:
                        self.pread.take(ticket)
                    except Exception:  # noqa: BLE001 - its error is the one being raised
                        pass
            elif not self.mmap.cancel(ticket):
                try:
                    self.mmap.wait(ticket)
                except Exception:  # noqa: BLE001
                    pass

    # -- reporting ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters of every streamed unit and their totals (see :func:`pyloader.stats`)."""
        units = {u.name: vars(u.stats).copy() for u in self.units}
        wait = sum(u.stats.wait_s for u in self.units)
        compute = sum(u.stats.compute_s for u in self.units)
        return {
            "strategy": self.strategy,
            "prefetch": self.depth,
            "streamed_units": len(self.units),
            "streamed_bytes_per_pass": sum(u.nbytes for u in self.units),
            "resident_bytes": self.resident_bytes,
            "derived_bytes": self.derived_bytes,
            "load_s": self.load_s,
            "passes": self.passes,
            "bytes_read": sum(u.stats.bytes_read for u in self.units),
            "wait_s": wait,
            "compute_s": compute,
            # Share of the streamed units' time not spent waiting for I/O.
            "overlap_efficiency": compute / (wait + compute) if wait + compute else 1.0,
            "units": units,
            **_process_memory(),
        }


def _process_memory() -> dict[str, int]:
    out = {"peak_memory": mx.get_peak_memory(), "active_memory": mx.get_active_memory()}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:  # not Linux
        pass
    return out


# ----------------------------------------------------------------------------
# Building the model


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def _units_of_layer(layer: nn.Module, path: str, granularity: str) -> list[tuple[str, nn.Module]]:
    if granularity == "layer":
        return [(path, layer)]
    total = sum(v.nbytes for _, v in tree_flatten(layer.parameters()))
    units = []
    for key, child in layer.children().items():
        if not isinstance(child, nn.Module):
            continue
        nbytes = sum(v.nbytes for _, v in tree_flatten(child.parameters()))
        # Norms and other small children stay with the resident remainder.
        if nbytes >= 0.01 * total:
            units.append((f"{path}.{key}", child))
    return units


def _source_map(model: nn.Module, ckpt: Checkpoint) -> tuple[dict[str, str], dict[str, Any]]:
    """Runs the model's ``sanitize`` on shape-only stand-ins of every tensor:
    parameters that come out as a stand-in map to their source tensor
    (possibly renamed); anything else is *derived* (computed by sanitize)."""
    metas = ckpt.tensors()
    stand_ins = {}
    for t in metas:
        stand_ins[t.name] = _placeholder(t.shape, _MLX_DTYPES.get(t.dtype, mx.uint8))
    by_id = {id(v): k for k, v in stand_ins.items()}
    out = model.sanitize(dict(stand_ins)) if hasattr(model, "sanitize") else stand_ins
    direct = {k: by_id[id(v)] for k, v in out.items() if id(v) in by_id}
    derived = {k: v for k, v in out.items() if id(v) not in by_id}
    return direct, derived


_MLX_DTYPES = {
    "BOOL": mx.bool_, "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16,
    "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64, "F16": mx.float16,
    "BF16": mx.bfloat16, "F32": mx.float32, "F64": mx.float64, "C64": mx.complex64,
}


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in
               ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_model(
    path: str | os.PathLike[str],
    *,
    strategy: str = "mmap",
    resident: int | float | str = 1.0,
    placement: str = "first_n",
    granularity: str = "layer",
    prefetch: int = 1,
    keep_page_cache: bool = False,
    read_backend: str = "threads",
    tokenizer: bool = True,
    group=None,
    shard: str = "pipeline",
    split=None,
    head: str | None = None,
):
    """Load an mlx-lm model with a resident set and the rest streamed from disk.

    Args:
        path: mlx-lm model directory (``config.json`` + safetensors).
        strategy: ``"mmap"`` or ``"pread"``: where streamed (and resident) weights come from.
        resident: Layers kept in memory: a count (int), a fraction (float in
            [0, 1]), a byte budget for all weights (str, e.g. ``"600MB"``) or
            a set of layer indices (e.g. ``pyloader.plan(...).resident_layers``).
            Non-layer weights (embeddings, final norm, lm_head) are always resident.
        placement: Which layers are resident: ``"first_n"``, ``"last_n"`` or
            ``"interleaved"`` (spread evenly).
        granularity: ``"layer"`` streams whole layers; ``"sublayer"`` streams each
            layer's attention and MLP blocks separately (small norms stay resident).
        prefetch: How many streamed units ahead to bring in while the current one
            computes (0 disables prefetching).
        keep_page_cache: mmap only: keep released units in the page cache (drop
            them from this process only).
        read_backend: pread only: ``"threads"`` or ``"io_uring"``.
        tokenizer: Load the tokenizer too, when the checkpoint has one.
        group: An ``mx.distributed.Group``: apply mlx-lm's pipeline sharding
            and load/stream only this rank's layers (``resident`` may then be
            a list with one value per rank). See ``pyloader.distributed``.
        shard: With ``group``: ``"pipeline"``.
        split: With ``group``: layers per rank (rank 0 runs the last layers),
            a ``distributed.SplitPlan``, or None for mlx-lm's even split.
        head: For a head bundle (``pyloader heads build``): the head to start
            with (default: the bundle's first). The model is then fully
            resident and gains ``swap_head``/``preload_heads``; see
            :mod:`pyloader.heads`.

    Returns:
        ``(model, tokenizer)``; ``tokenizer`` is None when the checkpoint has no
        tokenizer files. ``pyloader.stats(model)`` reports streaming counters.
    """
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    if strategy not in ("mmap", "pread"):
        raise ValueError(f"unknown strategy {strategy!r}; expected 'mmap' or 'pread'")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    path = Path(path)
    from . import heads

    if head is not None or heads.is_bundle(path):
        if group is not None:
            raise ValueError(f"{path}: a head bundle cannot be loaded with group= "
                             "(distributed loading takes a plain checkpoint)")
        return heads.load_model(path, head=head, resident=resident, tokenizer=tokenizer)
    t0 = time.perf_counter()
    ckpt = Checkpoint(path)

    # The model's structure (config, quantization) from mlx-lm itself; its lazy
    # mx.load arrays are never evaluated and are replaced below. A repacked
    # checkpoint's padding entries are not parameters: mlx-lm skips them here
    # (strict=False) and the strict load_weights below checks everything else.
    model, _ = mlx_lm_load_model(path, lazy=True, strict=not ckpt.padding_names)
    share = None
    if group is not None:
        from . import distributed

        share = distributed.shard_model(model, group, mode=shard, split=split)
        resident = distributed.rank_value(resident, share.rank, share.size)
    direct, derived = _source_map(model, ckpt)
    if share is not None:  # only this rank's tensors from here on
        direct, derived = share.restrict(model, direct, derived)

    layers = list(model.layers)
    paths = _module_paths(model)
    layer_paths = [paths[id(layer)] for layer in layers]
    prefix_of = {p: i for i, p in enumerate(layer_paths)}

    def layer_index(param: str) -> int | None:
        parts = param.split(".")
        for k in range(len(parts) - 1, 0, -1):
            i = prefix_of.get(".".join(parts[:k]))
            if i is not None:
                return i
        return None

    nbytes = {t.name: t.nbytes for t in ckpt.tensors()}
    layer_bytes = [0] * len(layers)
    fixed_bytes = 0
    for param, src in direct.items():
        i = layer_index(param)
        if i is None:
            fixed_bytes += nbytes[src]
        else:
            layer_bytes[i] += nbytes[src]
    # Streaming holds the unit computing and `prefetch` more being read.
    buffers = (prefetch + 1) * max(layer_bytes) if layer_bytes else 0
    keep = choose_resident(layer_bytes, resident, placement, fixed_bytes, buffers)

    ctl = StreamingController(ckpt, strategy, prefetch, keep_page_cache, read_backend)
    # Streamed units in execution order.
    streamed_params: dict[str, tuple[_Unit, str]] = {}
    for i, (layer, lpath) in enumerate(zip(layers, layer_paths)):
        if i in keep:
            continue
        for upath, module in _units_of_layer(layer, lpath, granularity):
            unit = _Unit(name=upath, module=module, order=len(ctl.units), params={}, nbytes=0)
            ctl.units.append(unit)
            for param, src in direct.items():
                if param.startswith(upath + "."):
                    local = param[len(upath) + 1:]
                    unit.params[local] = src
                    unit.nbytes += nbytes[src]
                    streamed_params[param] = (unit, local)

    # Weights: resident ones loaded now, streamed ones attached as views (mmap,
    # aligned) or placeholders, derived ones computed once and kept.
    meta = {t.name: t for t in ckpt.tensors()}
    resident_names = [src for p, src in direct.items() if p not in streamed_params]
    weights: dict[str, mx.array] = {}
    if strategy == "mmap":
        # Streamed misaligned tensors are copied in per use, not now.
        per_use = {p for p, src in direct.items()
                   if p in streamed_params and not meta[src].aligned and meta[src].nbytes}
        views = ctl.mmap.load(list(dict.fromkeys(
            src for p, src in direct.items() if p not in per_use)))
        if resident_names:
            ctl.mmap.wait(ctl.mmap.prefetch(list(dict.fromkeys(resident_names)), "populate"))
        for p, src in direct.items():
            if p in per_use:
                unit, local = streamed_params[p]
                unit.copied.append(local)
                t = meta[src]
                weights[p] = _placeholder(t.shape, _MLX_DTYPES.get(t.dtype, mx.uint8))
            else:
                weights[p] = views[src]
        del views
    else:
        loaded = ctl.pread.load(list(dict.fromkeys(resident_names)))
        for p, src in direct.items():
            if p in streamed_params:
                t = meta[src]
                weights[p] = _placeholder(t.shape, _MLX_DTYPES.get(t.dtype, mx.uint8))
            else:
                weights[p] = loaded[src]
        del loaded
    if derived:
        # sanitize computed these from several tensors: run it on the real ones.
        real = MmapReader(ckpt).load()
        computed = model.sanitize(real)
        for p in derived:
            weights[p] = computed[p]
        mx.eval([weights[p] for p in derived])
        ctl.derived_bytes = sum(weights[p].nbytes for p in derived)
        log.info("%d parameters computed by sanitize are kept resident (%d bytes)",
                 len(derived), ctl.derived_bytes)
        del real, computed
    model.load_weights(list(weights.items()), strict=True)
    if strategy == "pread":
        mx.eval([w for p, w in weights.items() if p not in streamed_params])
    del weights

    for unit in ctl.units:
        unit.controller = ctl
        object.__setattr__(unit.module, "_pyloader_unit", unit)
        unit.module.__class__ = _streamed_class(type(unit.module))
        if strategy == "mmap":
            # No read-around from faults into neighbouring tensors (often other
            # layers: mx.save_safetensors does not order tensors by layer);
            # prefetch reads exactly the unit's ranges instead.
            for src in unit.params.values():
                ctl.mmap.advise(src, "random")
            # Nothing of a streamed unit stays in memory until it runs.
            ctl.release(unit)
    ctl.resident_bytes = fixed_bytes + sum(layer_bytes[i] for i in keep) + ctl.derived_bytes
    # What pyloader.residency needs to move layers between resident and streamed.
    ctl.layout = {"layers": layers, "paths": layer_paths, "direct": direct,
                  "layer_bytes": layer_bytes, "fixed_bytes": fixed_bytes,
                  "granularity": granularity, "resident": set(keep)}
    ctl.load_s = time.perf_counter() - t0
    object.__setattr__(model, "_pyloader", ctl)
    if share is not None:
        share.finish(model)

    tok = load_tokenizer(path) if tokenizer and _has_tokenizer(path) else None
    return model, tok


def stats(model: nn.Module) -> dict[str, Any]:
    """Streaming counters of a model from :func:`load_model`: per unit loads,
    bytes read, time waiting for I/O and computing, the overlap efficiency,
    and this process's memory (peak RSS ``VmHWM``, ``RssAnon``, MLX peak)."""
    ctl = getattr(model, "_pyloader", None)
    if ctl is None:
        raise ValueError("this model was not loaded by pyloader.load_model")
    return ctl.stats()
