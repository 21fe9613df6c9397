"""Expert streaming: a mixture-of-experts layer reads only the experts its tokens route to.

mlx-lm runs a MoE layer's experts through one module holding them stacked (``SwitchGLU`` /
``SwitchMLP``, whose ``SwitchLinear`` / ``QuantizedSwitchLinear`` projections hold weights
``[E, out, in]``) and calls it as ``switch(x, indices)`` with each token's top-k expert
ids. With an expert cache, each such module's stacked parameters are replaced by the
arrays of an :class:`~pyloader._core.ExpertBank`: ``slots + 1`` experts of fixed shape (the
last one a zero scratch slot). An ``"experts"`` hook on the module

1. evaluates ``indices`` (one synchronization per MoE layer: the routing must be known),
2. asks the cache policy (:class:`CachePolicy`: LRU or LFU) which routed experts are in
   the bank and which slots the others replace, and reads the missing experts into their
   slots (:class:`~pyloader._core.ExpertReader`: positional reads, merged where
   consecutive experts go to consecutive slots, in parallel, without the GIL),
3. calls mlx-lm's own module with the expert ids remapped to slot ids: the same
   ``gather_mm`` / ``gather_qmm`` on a smaller stack, so every token gets bit-identical
   results.

When one call routes to more experts than the bank has slots (a long prompt chunk, or
fewer slots than top-k), the experts are served in rounds of at most ``slots``: each round
routes the tokens of the other experts to the scratch slot, and the rounds' outputs are
combined by selection (no arithmetic), so the result is still exact; every routed expert
is read once per call (expert-major).

The bookkeeping (:class:`~.expert_slots.ExpertSlots`: the policies, the counters, the
simulator) is pure Python and deterministic, in :mod:`.expert_slots`; this module finds
the MoE modules, sizes their caches and serves them.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .._native import core
from .._util.hooks import add_hook, get_hook, remove_hook
from .._util.sizes import parse_bytes
from ..errors import UnsupportedError
from ..io.checkpoint import Checkpoint, TensorMeta
from ..io.readers import zero_copy_mode
from .expert_slots import COUNTERS, ExpertSlots, Round, RoutingTrace, hit_rate

#: ``StreamOptions(experts=...)`` that keeps the experts inside their layers (no cache).
LAYER = "layer"
#: The key of the expert caches' hook on their modules.
HOOK = "experts"
#: Where cached experts live (``StreamOptions(expert_source=...)``): :class:`BankExperts`,
#: :class:`MappedExperts`.
EXPERT_SOURCES = ("bank", "mmap")

__all__ = ["COUNTERS", "EXPERT_SOURCES", "HOOK", "LAYER", "BankExperts", "ExpertCache",
           "MappedExperts", "MoeModule", "cache_memory", "cache_slots", "expert_modules",
           "routing_trace", "slots_for"]


# ----------------------------------------------------------------------------
# Finding the MoE modules


def _switch_classes() -> tuple[type, ...]:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return SwitchLinear, QuantizedSwitchLinear


def _takes_indices(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(type(module).__call__).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and params[2] == "indices"


def expert_modules(layer: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every module under ``layer`` that holds stacked experts
    (``SwitchLinear`` / ``QuantizedSwitchLinear`` children) and is called as
    ``module(x, indices)``: mlx-lm's ``SwitchGLU`` and ``SwitchMLP``.

    Raises ValueError for stacked experts held by a module with another call signature
    (the hook could not tell which argument is the routing)."""
    switch = _switch_classes()
    out = []
    for name, module in layer.named_modules():
        children = [c for c in module.children().values() if isinstance(c, switch)]
        if not children:
            continue
        full = f"{path}.{name}" if name else path
        if not _takes_indices(module):
            raise ValueError(
                f"{full} ({type(module).__name__}) holds stacked experts but is not called "
                "as module(x, indices) like mlx-lm's SwitchGLU / SwitchMLP; expert "
                "streaming cannot serve it (load with experts='layer')")
        out.append((full, module))
    return out


def slots_for(experts, num_experts: int, memory_for: Callable[[int], int]) -> int:
    """Slots per layer for ``StreamOptions(experts=...)``: an int (slots), a float in (0, 1]
    (a fraction of each layer's experts, at least one slot) or a byte budget for every
    layer's cache together: the most slots (the same in every layer) for which
    ``memory_for(slots)``, the memory all the caches take, fits the budget."""
    if isinstance(experts, bool):
        raise TypeError("experts must be 'layer', an int, a float in (0, 1] or a byte budget")
    if isinstance(experts, int):
        if experts < 1:
            raise ValueError(f"experts={experts}: a cache needs at least one slot per layer")
        return min(experts, num_experts)
    if isinstance(experts, float):
        if not 0.0 < experts <= 1.0:
            raise ValueError(f"experts fraction must be in (0, 1], got {experts}")
        return max(1, min(num_experts, round(experts * num_experts)))
    if isinstance(experts, str):
        budget = parse_bytes(experts)
        if memory_for(1) > budget:
            raise MemoryError(
                f"experts={experts!r}: a cache of one expert in every MoE layer takes "
                f"{memory_for(1)} bytes (with the bank's scratch slot and layout), more than "
                f"the budget of {budget} bytes")
        lo, hi = 1, num_experts  # memory_for(lo) fits; find the largest that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if memory_for(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo
    raise TypeError("experts must be 'layer', an int, a float in (0, 1] or a byte budget")


def cache_memory(source: str, strides: Sequence[int], slots: int) -> int:
    """Memory one expert cache of ``slots`` slots takes, for stacked tensors whose
    one-expert sizes are ``strides``: a bank (``"bank"``: scratch slot and layout
    included, exactly what :class:`~pyloader._core.ExpertBank` allocates) or the mapped
    pages of the cached experts (``"mmap"``)."""
    if source == "mmap":
        return slots * sum(strides)
    return core.ExpertBank.layout_bytes(list(strides), slots)


def cache_slots(experts, layers: Sequence[tuple[int, Sequence[int]]],
                source: str) -> list[int]:
    """Slots of each expert cache for ``StreamOptions(experts=...)`` (see :func:`slots_for`),
    where ``layers`` gives every MoE module's ``(num_experts, strides)``: a byte budget
    covers all the caches together, none holding more slots than it has experts. What
    loading allocates and what planning counts."""
    def memory_for(slots: int) -> int:
        return sum(cache_memory(source, strides, min(slots, n)) for n, strides in layers)

    return [slots_for(experts, n, memory_for) for n, _ in layers]


# ----------------------------------------------------------------------------
# The live cache


@dataclass(eq=False)
class MoeModule:
    """One mixture-of-experts module found in a decoder layer: what its cache serves.

    Attributes:
        path: Module path (``"model.layers.3.mlp.switch_mlp"``).
        module: The module.
        layer: Index of its decoder layer.
        sources: Its stacked ``[E, ...]`` tensors by parameter path relative to it.
        strides: Bytes of one expert in each of them.
        slots: Experts its cache holds at once.
    """

    path: str
    module: nn.Module
    layer: int
    sources: dict[str, TensorMeta]
    strides: list[int]
    slots: int = 0

    @property
    def num_experts(self) -> int:
        return next(iter(self.sources.values())).shape[0]


class ExpertCache(ABC):
    """One MoE module's experts, served from a cache of ``slots`` experts (see the module
    doc). Two sources: :class:`BankExperts` (slots of a bank, read with pread) and
    :class:`MappedExperts` (the page cache: views of the stacked tensors, each expert's
    pages populated when it enters the cache and dropped when it leaves).

    Attributes:
        name: Module path (``"model.layers.3.mlp.switch_mlp"``).
        module: The module (hooked with ``"experts"`` while the cache serves it).
        layer: Index of its decoder layer.
        sources: Parameter path relative to the module → its stacked checkpoint tensor.
        slots: The bookkeeping (:class:`ExpertSlots`), with the counters.
        trace: The routing of each call while a :func:`routing_trace` records, else None.
        lock: Held by each call from the routing to the output: one caller at a time
            changes the slots (the controller's lock, shared by every cache and
            streamed unit of a model; a private one until the controller sets it).
    """

    def __init__(self, found: MoeModule, policy: str):
        name, capacity = found.path, found.slots
        self.name, self.module, self.layer = name, found.module, found.layer
        self.sources = sources = found.sources
        experts = {t.shape[0] if t.shape else 0 for t in sources.values()}
        if len(experts) != 1 or 0 in experts:
            raise ValueError(f"{name}: its tensors do not stack one expert count "
                             f"({ {t.name: t.shape for t in sources.values()} })")
        num_experts = experts.pop()
        self.slots = ExpertSlots(num_experts, min(capacity, num_experts), policy)
        self.trace: Optional[list[list[int]]] = None
        self.lock = threading.RLock()

    @property
    def num_experts(self) -> int:
        return self.slots.num_experts

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert over every tensor."""
        return sum(t.nbytes // t.shape[0] for t in self.sources.values())

    @property
    def resident(self) -> bool:
        """Every expert fits: all are brought in once and no hook is needed."""
        return self.slots.capacity >= self.num_experts

    @property
    @abstractmethod
    def memory_bytes(self) -> int:
        """Memory the cache holds at most."""

    @abstractmethod
    def arrays(self) -> dict[str, mx.array]:
        """The module's parameters (local path → array)."""

    def load_all(self) -> None:
        """Bring every expert in (a cache with room for all of them)."""
        for _, r in self.slots.rounds(np.arange(self.num_experts)):
            self._bring(r)

    @abstractmethod
    def _bring(self, r: Round) -> None:
        """Bring one round's missing experts in (and let its evicted ones go)."""

    def _routing(self, indices) -> tuple[np.ndarray, np.ndarray]:
        ids = np.array(indices)  # the routing: one synchronization
        experts = np.unique(ids)
        if self.trace is not None:
            self.trace.append(experts.tolist())
        return ids, experts

    def _timed(self, fn, *args) -> None:
        t0 = time.perf_counter()
        fn(*args)
        self.slots.stats.stall_s += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        """Its counters, with the slot count and hit rate."""
        d = asdict(self.slots.stats)
        d.update(slots=self.slots.capacity, experts=self.num_experts,
                 bank_bytes=self.memory_bytes, hit_rate=hit_rate(d))
        return d


class BankExperts(ExpertCache):
    """Experts read into the slots of an :class:`~pyloader._core.ExpertBank`; the module
    computes on the bank with expert ids remapped to slot ids (``expert_source="bank"``).

    A round's missing experts are read before its one call. (Computing the cached experts
    while the missing ones are read would take two calls, each with the other part's rows
    on the scratch slot: every expert row computed twice, which costs more than the reads
    it hides.)"""

    def __init__(self, found: MoeModule, policy: str, ckpt: Checkpoint, reader):
        super().__init__(found, policy)
        self.bank = core.ExpertBank.create(ckpt.index, [t.name for t in self.sources.values()],
                                           self.slots.capacity)
        self.reader = reader

    @property
    def memory_bytes(self) -> int:
        return self.bank.allocated_bytes

    def arrays(self) -> dict[str, mx.array]:
        return dict(zip(self.sources, self.bank.arrays()))

    def _bring(self, r: Round) -> None:
        if r.moves:
            self._timed(self._read, r.moves)

    def _read(self, moves: list[tuple[int, int]]) -> None:
        r = self.reader.load(self.bank, moves)
        self.slots.stats.bytes_read += r["bytes"]
        self.slots.stats.reads += r["reads"]

    def __call__(self, module, call, x, indices, *args, **kwargs):
        """The ``"experts"`` hook (see the module doc). The output is evaluated before
        the hook returns, under :attr:`lock`: the next call refills the slots it reads,
        and that call may come from another thread before this one's graph runs (two
        threads generating on one model), so nothing may read the slots later."""
        # The bank's slots are refilled in place, so every computation that reads them
        # must have run before a refill: the routing is evaluated first, each round's
        # output before the next round's refill, and the whole output before the hook
        # returns. On Metal this ordering is the only guard: MLX's buffers are
        # hazard-untracked, so a GPU kernel still reading a slot would see the new
        # expert. Keep every evaluation.
        with self.lock:
            ids, experts = self._routing(indices)
            scratch = self.bank.scratch_slot
            out = None
            for group, r in self.slots.rounds(experts):
                table = self.slots.table(scratch)
                if len(group) < len(experts):  # this round serves only its own experts
                    keep = np.full(self.num_experts, scratch, dtype=np.int64)
                    keep[group] = table[group]
                    table = keep
                self._bring(r)
                part = call(x, mx.array(table[ids].astype(ids.dtype)), *args, **kwargs)
                if len(group) == len(experts):
                    out = part
                    break
                mask = mx.array(np.isin(ids, group))
                out = part if out is None else mx.where(mx.expand_dims(mask, -1), part, out)
                mx.eval(out)  # the next round refills the slots this one reads
            mx.eval(out)
            return out


class MappedExperts(ExpertCache):
    """Experts served from the page cache (``expert_source="mmap"``): the module keeps
    zero-copy views of the whole stacked tensors; an expert entering the cache has its
    pages read in and mapped (``MADV_POPULATE_READ``), one leaving it has them dropped from
    this process (``MADV_DONTNEED``) and, unless ``keep_page_cache``, from the page cache.
    The routing is not remapped. Needs aligned stacked tensors (``pyloader repack``)."""

    def __init__(self, found: MoeModule, policy: str, reader, keep_page_cache: bool):
        super().__init__(found, policy)
        name, sources = self.name, self.sources
        mode = zero_copy_mode()
        if mode != "header":
            # make_buffer (Metal) would wrap every stacked tensor whole: all experts wired
            # in MLX's residency set; copy (CUDA) would copy all of them.
            raise UnsupportedError(
                f"{name}: expert_source='mmap' serves experts from views of the whole "
                f"stacked tensors, and this MLX makes them with {mode!r} (all experts "
                f"{'wired' if mode == 'make_buffer' else 'copied'}, not a cache); use "
                "expert_source='bank'")
        bad = [t.name for t in sources.values() if not t.aligned]
        if bad:
            raise ValueError(
                f"{name}: expert_source='mmap' needs zero-copy views, and {bad[0]} sits at "
                "an offset that is not a multiple of its item size (a checkpoint written by "
                "mx.save_safetensors); rewrite it with `pyloader repack` or use "
                "expert_source='bank'")
        self.reader = reader
        self.keep_page_cache = keep_page_cache
        self._ranges = [(t.file, t.offset, t.nbytes // t.shape[0]) for t in sources.values()]
        self._names = [t.name for t in sources.values()]

    @property
    def memory_bytes(self) -> int:
        return self.slots.capacity * self.expert_bytes

    def arrays(self) -> dict[str, mx.array]:
        views = self.reader.load(self._names)
        for name in self._names:
            self.reader.advise(name, "random")  # exactly the experts asked for
        return {p: views[t.name] for p, t in self.sources.items()}

    def _bring(self, r: Round) -> None:
        for e in r.evicted:
            for f, off, stride in self._ranges:
                self.reader.advise_range(f, off + e * stride, stride, "dontneed")
                if not self.keep_page_cache:
                    self.reader.advise_range(f, off + e * stride, stride, "evict")
        if r.moves:
            self._timed(self._populate, [e for e, _ in r.moves])

    def _populate(self, experts: list[int]) -> None:
        for e in experts:
            for f, off, stride in self._ranges:
                self.reader.advise_range(f, off + e * stride, stride, "populate")
                self.slots.stats.bytes_read += stride
                self.slots.stats.reads += 1

    def __call__(self, module, call, x, indices, *args, **kwargs):
        """The ``"experts"`` hook: bring the routed experts' pages in, then compute (the
        views read the file: a page dropped before the graph runs faults back in)."""
        with self.lock:
            _, experts = self._routing(indices)
            for _, r in self.slots.rounds(experts):
                self._bring(r)
        return call(x, indices, *args, **kwargs)


@contextlib.contextmanager
def routing_trace(caches: Sequence[ExpertCache]) -> Iterator[RoutingTrace]:
    """Records the routing of every call of ``caches`` while the block runs. Caches that
    hold every expert (no hook otherwise) are hooked for the duration: recording costs
    them one synchronization per call."""
    trace = RoutingTrace()
    added = []
    for c in caches:
        c.trace = trace.layers.setdefault(c.name, [])
        trace.num_experts[c.name] = c.num_experts
        if get_hook(c.module, HOOK) is None:
            add_hook(c.module, HOOK, c)
            added.append(c)
    try:
        yield trace
    finally:
        for c in caches:
            c.trace = None
        for c in added:
            remove_hook(c.module, HOOK)
