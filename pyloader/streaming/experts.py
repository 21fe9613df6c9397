"""Expert streaming: a mixture-of-experts layer reads only the experts its tokens route to.

An ``"experts"`` hook on mlx-lm's ``SwitchGLU``/``SwitchMLP`` evaluates the routing, reads
missing experts into a fixed cache, and calls mlx-lm's own module (on a bank with ids
remapped to slots, or on page-cache views), so results are bit-identical. Calls routing to
more experts than slots are served in exact rounds. Bookkeeping: :mod:`.expert_slots`.
See docs/expert-streaming.md.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

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
#: Where cached experts live (``StreamOptions(expert_source=...)``).
EXPERT_SOURCES = ("bank", "mmap")

__all__ = ["COUNTERS", "EXPERT_SOURCES", "HOOK", "LAYER", "BankExperts", "ExpertCache",
           "MappedExperts", "MoeModule", "cache_memory", "cache_slots", "expert_modules",
           "routing_trace", "slots_for"]


def _switch_classes() -> tuple[type, ...]:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return SwitchLinear, QuantizedSwitchLinear


def _stacks_experts(module: nn.Module, switch: tuple[type, ...]) -> bool:
    """mlx-lm's stacked-expert linear layers, and any class that says it is one
    (``stacked_experts = True``: ``[E, ...]`` parameters, called as ``(x, indices)``)."""
    return isinstance(module, switch) or getattr(type(module), "stacked_experts", False)


def _takes_indices(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(type(module).__call__).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and params[2] == "indices"


def expert_modules(layer: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every module under ``layer`` holding stacked experts
    and called as ``module(x, indices)`` (mlx-lm's ``SwitchGLU``, ``SwitchMLP``).

    Raises ValueError for stacked experts held by a module with another call signature.
    """
    switch = _switch_classes()
    out = []
    for name, module in layer.named_modules():
        children = [c for c in module.children().values() if _stacks_experts(c, switch)]
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
    """Slots per layer for ``StreamOptions(experts=...)``: an int, a fraction of the
    layer's experts (at least one), or a byte budget: the most slots for which
    ``memory_for(slots)`` fits."""
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
        # the most slots that fit (memory_for grows with the slots; one slot fits)
        return bisect.bisect_right(range(1, num_experts + 1), budget, key=memory_for)
    raise TypeError("experts must be 'layer', an int, a float in (0, 1] or a byte budget")


def cache_memory(source: str, strides: Sequence[int], slots: int) -> int:
    """Memory one expert cache of ``slots`` slots takes, for one-expert sizes
    ``strides``: a bank (exactly what :class:`~pyloader._core.ExpertBank` allocates) or the
    mapped pages (``"mmap"``)."""
    if source == "mmap":
        return slots * sum(strides)
    return core.ExpertBank.layout_bytes(list(strides), slots)


def cache_slots(experts, layers: Sequence[tuple[int, Sequence[int]]],
                source: str) -> list[int]:
    """Slots of each expert cache, ``layers`` giving every MoE module's
    ``(num_experts, strides)``; a byte budget covers all caches together."""
    def memory_for(slots: int) -> int:
        return sum(cache_memory(source, strides, min(slots, n)) for n, strides in layers)

    return [slots_for(experts, n, memory_for) for n, _ in layers]


@dataclass(eq=False)
class MoeModule:
    """One mixture-of-experts module of decoder layer ``layer``: its stacked ``[E, ...]``
    ``sources`` (by parameter path relative to it), the bytes of one expert in each
    (``strides``), and the experts its cache holds at once (``slots``)."""

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
    """One MoE module's experts, served from a cache (``slots``: its
    :class:`ExpertSlots`, with the counters); the module is hooked with ``"experts"``
    while the cache serves it. ``trace``: each call's routing while a
    :func:`routing_trace` records; ``lock``: held from a call's routing to its output."""

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
        self.trace: list[list[int]] | None = None
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
    """Experts read into the slots of an :class:`~pyloader._core.ExpertBank`; the
    module computes on the bank with expert ids remapped to slot ids (``expert_source="bank"``)."""

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
        """The ``"experts"`` hook. The output is evaluated before returning,
        under :attr:`lock`, because the next call refills the slots it reads."""
        # Slots are refilled in place: every computation reading them must run before a refill
        # (on Metal this ordering is the only guard). Keep every evaluation.
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
    """Experts served from the page cache (``expert_source="mmap"``): zero-copy
    views of the stacked tensors, each expert's pages populated on entry and dropped on exit.
    The routing is not remapped. Needs aligned stacked tensors (``pyloader repack``)."""

    def __init__(self, found: MoeModule, policy: str, reader, keep_page_cache: bool):
        super().__init__(found, policy)
        name, sources = self.name, self.sources
        mode = zero_copy_mode()
        if mode != "header":
            # make_buffer/copy would wire or copy every stacked tensor whole.
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
        """The ``"experts"`` hook: bring the routed experts' pages in, then compute."""
        with self.lock:
            _, experts = self._routing(indices)
            for _, r in self.slots.rounds(experts):
                self._bring(r)
        return call(x, indices, *args, **kwargs)


@contextlib.contextmanager
def routing_trace(caches: Sequence[ExpertCache]) -> Iterator[RoutingTrace]:
    """Records the routing of every call of ``caches`` while the block runs
    (fully resident caches are hooked for the duration)."""
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
