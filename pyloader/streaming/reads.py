"""How a streamed unit's bytes come in and go out: :class:`MmapReads` (zero-copy
views whose pages are populated per request and dropped at release; misaligned tensors
copied per use) and :class:`PreadReads` (``depth + 1`` reusable buffers, ``O_DIRECT``
unless ``keep_page_cache``; a buffer still held is never overwritten). See
docs/streaming.md."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..io.checkpoint import Checkpoint, TensorMeta
from ..io.readers import MmapReader, PreadReader, views_cost_nothing
from .sources import placeholder, stand_in
from .units import Unit


def _attach(unit: Unit, arrays: dict[str, mx.array], local: list[str]) -> None:
    unit.module.update(tree_unflatten([(p, arrays[unit.sources[p].name]) for p in local]))


def _to_placeholders(unit: Unit, local: list[str]) -> None:
    """Replace ``local`` parameters of ``unit`` by their stand-ins (made once per unit)."""
    if local:
        cached = unit.stand_ins
        missing = [p for p in local if p not in cached]
        if missing:
            current = dict(tree_flatten(unit.module.parameters()))
            for p in missing:
                cached[p] = placeholder(current[p].shape, current[p].dtype,
                                        unserved_message(unit, p))
        unit.module.update(tree_unflatten([(p, cached[p]) for p in local]))


def unserved_message(unit: Unit, param: str) -> str:
    """What evaluating the stand-in of ``unit``'s ``param`` raises."""
    return (f"pyloader: {unit.name}.{param} (layer {unit.layer}, streamed) was read by a "
            f"computation while its unit {unit.name!r} was not in memory: the model's "
            f"forward reaches it other than through {unit.name}'s own call, which is "
            "where pyloader brings a streamed unit in. Load this model with resident=1.0 "
            "(every layer in memory); no token computed from the missing weights was "
            "returned")


class UnitReads(ABC):
    """Reads of one checkpoint for a streaming controller. ``keep_page_cache``: released
    units stay in the page cache (mmap honours a change between passes; pread fixes it)."""

    #: The underlying :class:`~pyloader.MmapReader` or :class:`~pyloader.PreadReader`.
    reader: MmapReader | PreadReader

    def __init__(self, ckpt: Checkpoint, keep_page_cache: bool = False):
        self.checkpoint = ckpt
        self.keep_page_cache = keep_page_cache

    @abstractmethod
    def initial_weights(self, direct: dict[str, TensorMeta], streamed: set[str],
                        overlap: bool = False) -> dict[str, mx.array]:
        """Every direct parameter's array at load: resident ones read,
        streamed ones free until their unit runs. ``overlap``: return before the resident bytes are
        in; each array waits for its own bytes when evaluated."""

    def copied_params(self, unit: Unit) -> list[str]:
        """The unit's parameters read per use instead of viewed."""
        return []

    def start_streaming(self, unit: Unit) -> None:
        """``unit`` streams from now on: nothing of it stays in memory until it runs."""
        self.release(unit)

    @abstractmethod
    def request(self, unit: Unit) -> int:
        """Start reading ``unit`` in the background; a ticket for :meth:`bring_in`."""

    @abstractmethod
    def bring_in(self, unit: Unit, ticket: int | None) -> None:
        """Put the unit's weights in place (waiting for ``ticket``, or reading now)."""

    @abstractmethod
    def release(self, unit: Unit) -> None:
        """Drop the unit's weights from this process and, unless
        ``keep_page_cache``, from the page cache (mmap: queued, see :meth:`settle`)."""

    def settle(self) -> None:
        """Block until released units' pages are gone."""

    def plan_buffers(self, units: list[Unit], depth: int) -> None:
        """Size what the read path keeps for ``units`` with ``depth`` requested ahead."""

    @abstractmethod
    def admit(self, unit: Unit) -> None:
        """``unit`` stops streaming: its weights are loaded for good."""

    def cancel(self, ticket: int) -> bool:
        """Drop a request that has not started (True if dropped)."""
        return self.reader.cancel(ticket)

    def discard(self, ticket: int) -> None:
        """Cancel a request, or wait it out; its result and error are dropped."""
        if not self.reader.cancel(ticket):
            with contextlib.suppress(Exception):  # not the error being raised
                self._finish(ticket)

    def withdraw(self, unit: Unit, ticket: int) -> None:
        """Drop an unused request of ``unit``: cancel it, or wait it out and drop its data."""
        self.discard(ticket)

    @abstractmethod
    def _finish(self, ticket: int) -> None:
        """Wait for a request that already started (raising its error)."""

    def check_unchanged(self) -> None:
        """Raise OSError (ESTALE) if a file changed under views already handed out."""

    def trace_enable(self, on: bool) -> None:
        """Start (clearing) or stop recording the reader threads' work."""
        self.reader.trace_enable(on)

    def take_trace(self) -> tuple[list[tuple], int]:
        """The reader threads' work since the last call: ``(events, dropped)``,
        each event ``(kind, ticket, thread_id, start_ns, end_ns, bytes)``."""
        return self.reader.take_trace()

    def stats(self) -> dict:
        """The reader's counters."""
        return self.reader.stats()


class MmapReads(UnitReads):
    """Zero-copy views; prefetch populates the mapping."""

    def __init__(self, ckpt: Checkpoint, keep_page_cache: bool = False):
        super().__init__(ckpt, keep_page_cache)
        self.reader = MmapReader(ckpt)
        self._views_stay = views_cost_nothing()

    def _per_use(self, t: TensorMeta) -> bool:
        """Attached at each use and dropped at release, rather than kept as a view."""
        return bool(t.nbytes) and not (t.aligned and self._views_stay)

    def initial_weights(self, direct, streamed, overlap=False):
        per_use = {p for p in streamed if self._per_use(direct[p])}
        resident = {t.name: t for p, t in direct.items() if p not in streamed}
        views = self.reader.load(list(dict.fromkeys(
            t.name for p, t in direct.items() if p not in per_use and p in streamed)))
        if overlap:  # populated in file order in the background
            views.update(self.reader.load_overlapped(list(resident)))
        else:
            views.update(self.reader.load(list(resident)))
            # Only views are populated: copies were read from the file already.
            populate = [n for n, t in resident.items() if t.aligned and t.nbytes]
            if populate:
                self.reader.wait(self.reader.prefetch(populate, "populate"))
        return {p: stand_in(t) if p in per_use else views[t.name] for p, t in direct.items()}

    def copied_params(self, unit):
        return [p for p, t in unit.sources.items() if self._per_use(t)]

    def start_streaming(self, unit):
        # No fault read-around into neighbouring tensors: requests read exactly the unit's ranges.
        for name in unit.tensor_names:
            self.reader.advise(name, "random")
        self.release(unit)
        self.settle()  # shed() and attach() report memory that is really gone

    def request(self, unit):
        return self.reader.prefetch(unit.tensor_names, "populate")

    def bring_in(self, unit, ticket):
        # A truncated or rewritten file raises OSError here, before any view is touched
        # (docs/RELIABILITY.md).
        self.reader.check_unchanged()
        # No request in flight: map the pages now so an I/O error surfaces as OSError here.
        self.reader.wait(ticket if ticket is not None else self.request(unit))
        if unit.copied:
            _attach(unit, self.reader.load([unit.sources[p].name for p in unit.copied]),
                    unit.copied)

    def release(self, unit):
        # Queued ahead of the worker's requests, so a later request runs after the drop.
        self.reader.drop(unit.tensor_names, evict=not self.keep_page_cache)
        _to_placeholders(unit, unit.copied)

    def settle(self):
        self.reader.settle()

    def withdraw(self, unit, ticket):
        if not self.reader.cancel(ticket):
            with contextlib.suppress(Exception):  # a read nobody uses: its error is moot
                self.reader.wait(ticket)
            self.reader.drop(unit.tensor_names, evict=not self.keep_page_cache)

    def admit(self, unit):
        names = unit.tensor_names
        self.reader.wait(self.reader.prefetch(names, "populate"))
        for name in names:
            self.reader.advise(name, "normal")
        if unit.copied:
            arrays = self.reader.load([unit.sources[p].name for p in unit.copied])
            _attach(unit, arrays, unit.copied)
            mx.eval(list(arrays.values()))

    def _finish(self, ticket):
        self.reader.wait(ticket)

    def check_unchanged(self):
        self.reader.check_unchanged()


#: The pread strategy's largest single read while streaming units.
STREAM_CHUNK = 16 << 20


class PreadReads(UnitReads):
    """Reads into reusable buffers."""

    def __init__(self, ckpt: Checkpoint, keep_page_cache: bool = False,
                 read_backend: str = "threads"):
        super().__init__(ckpt, keep_page_cache)
        self.reader = PreadReader(ckpt, backend=read_backend, readahead=False,
                                   drop_cache=not keep_page_cache, chunk_bytes=STREAM_CHUNK)
        self._slot_bytes = 0

    def initial_weights(self, direct, streamed, overlap=False):
        names = list(dict.fromkeys(t.name for p, t in direct.items() if p not in streamed))
        loaded = (self.reader.load_overlapped(names) if overlap
                  else self.reader.load(names))
        return {p: stand_in(t) if p in streamed else loaded[t.name] for p, t in direct.items()}

    def plan_buffers(self, units, depth):
        slots = min(depth + 1, len(units))
        need = max((self.reader.layout_bytes(u.tensor_names) for u in units), default=0)
        r = self.reader
        if slots == r.buffer_slots and need <= self._slot_bytes:
            return
        r.reserve_buffers(slots if need else 0, need, direct=not self.keep_page_cache)
        self._slot_bytes = need

    def request(self, unit):
        return self.reader.submit(unit.tensor_names, reuse=True)

    def bring_in(self, unit, ticket):
        arrays = (self.reader.take(ticket) if ticket is not None
                  else self.reader.load(unit.tensor_names, reuse=True))
        _attach(unit, arrays, list(unit.sources))

    def release(self, unit):
        _to_placeholders(unit, list(unit.sources))

    def admit(self, unit):
        arrays = self.reader.load(unit.tensor_names)
        _attach(unit, arrays, list(unit.sources))
        mx.eval(list(arrays.values()))

    def _finish(self, ticket):
        self.reader.take(ticket)  # the arrays are dropped


def make_reads(ckpt: Checkpoint, strategy: str, keep_page_cache: bool,
               read_backend: str) -> UnitReads:
    """The read path of ``strategy`` (``"mmap"`` or ``"pread"``)."""
    if strategy == "mmap":
        return MmapReads(ckpt, keep_page_cache)
    if strategy == "pread":
        return PreadReads(ckpt, keep_page_cache, read_backend)
    raise ValueError(f"unknown strategy {strategy!r}; expected 'mmap' or 'pread'")
