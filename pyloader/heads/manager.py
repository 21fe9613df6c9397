"""Task heads: atomic hot swap, preload, usage history. See docs/heads-and-repack.md."""

from __future__ import annotations

import collections
import contextlib
import logging
import tempfile
import time
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
from mlx.utils import tree_unflatten

from .._util.hooks import add_mixin, attach_handle, handle_of
from .._util.host import io_counters
from ..errors import HeadChecksumError, HeadError, HeadIOError, HeadMismatchError
from ..io.checkpoint import Checkpoint
from ..io.config import check_config
from ..io.readers import MmapReader
from ..streaming import SourceMap
from .bundle import TRUNK_FILE, Bundle

log = logging.getLogger(__name__)

#: Bytes :meth:`Head.bring_in` reads per step (the CRC of one step overlaps the next reads).
BRING_IN_CHUNK = 16 << 20


@dataclass
class SwapStats:
    """One swap: its time, whether the head was preloaded, and its I/O counters."""

    head: str
    previous: str
    warm: bool
    seconds: float
    head_bytes: int
    populate_bytes: int = 0
    bytes_read: int = 0
    rchar: int | None = None
    read_bytes: int | None = None


class Head:
    """One head's checkpoint, reader and (once brought in) arrays."""

    def __init__(self, bundle: Bundle, name: str):
        self.name = name
        self.entry = bundle.entry(name)
        self.file = str(bundle.head_file(name))
        try:
            self.ckpt = Checkpoint(self.file)
        except OSError as exc:
            raise HeadIOError(f"cannot open the head file: {exc}", head=name,
                              file=self.file) from exc
        except ValueError as exc:  # FormatError
            raise HeadMismatchError(f"the head file is not valid safetensors: {exc}",
                                    head=name, file=self.file) from exc
        want = self.entry["tensors"]
        for n in want:
            if n not in self.ckpt:
                raise HeadMismatchError("tensor missing from the head file", head=name,
                                        file=self.file, tensor=n)
        for n in self.ckpt.keys():
            if n not in want:
                raise HeadMismatchError("tensor not in the bundle's directory", head=name,
                                        file=self.file, tensor=n)
            t, w = self.ckpt[n], want[n]
            if t.dtype != w["dtype"] or t.shape != w["shape"]:
                raise HeadMismatchError(
                    f"dtype/shape {t.dtype}{list(t.shape)} differs from the directory's "
                    f"{w['dtype']}{list(w['shape'])}", head=name, file=self.file, tensor=n)
        self.names = list(want)
        self.nbytes = sum(self.ckpt[n].nbytes for n in self.names)
        self.reader = MmapReader(self.ckpt)
        self.arrays: dict[str, Any] | None = None
        self.future: Future | None = None  # a preload in flight
        self.auto = False                  # preloaded by the policy

    def bring_in(self) -> None:
        """Read in the head, create its arrays and verify every CRC (HeadError); thread-safe."""
        chunks: list[list[str]] = [[]]
        size = 0
        for n in self.names:
            if size >= BRING_IN_CHUNK:
                chunks.append([])
                size = 0
            chunks[-1].append(n)
            size += self.ckpt[n].nbytes
        arrays: dict[str, Any] = {}
        tickets: list[int] = []
        try:
            tickets = [self.reader.prefetch(c, "populate") for c in chunks]
            for chunk, ticket in zip(chunks, tickets):
                self.reader.wait(ticket)
                part = self.reader.load(chunk)
                # The CRC reads the pages the model will use (zlib releases the GIL).
                for n in chunk:
                    crc = zlib.crc32(part[n])
                    want = self.entry["tensors"][n]["crc32"]
                    if crc != want:
                        raise HeadChecksumError(
                            f"CRC-32 {crc:#010x} does not match the bundle's {want:#010x} "
                            "(corrupt or modified head file)", head=self.name, file=self.file,
                            tensor=n)
                arrays.update(part)
        except OSError as exc:
            raise HeadIOError(f"reading the head failed: {exc}", head=self.name,
                              file=self.file) from exc
        finally:
            if len(arrays) != len(self.names):
                for t in tickets:  # stop reading a head that failed
                    self.reader.cancel(t)
        self.arrays = arrays

    def release(self) -> None:
        """Drop this head's arrays and the reader's mappings."""
        if self.future is not None:
            self.future.cancel()
        self.arrays = None
        self.reader.close()


@dataclass
class HeadUsage:
    """Which heads were active: ``history`` of ``(time.time(), name)``."""

    history: list[tuple[float, str]] = field(default_factory=list)

    def record(self, name: str) -> None:
        self.history.append((time.time(), name))

    def counts(self) -> collections.Counter:
        return collections.Counter(n for _, n in self.history)

    def transitions(self) -> dict[str, collections.Counter]:
        """``{from: Counter(to)}`` over consecutive activations."""
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        seq = [n for _, n in self.history]
        for a, b in zip(seq, seq[1:]):
            out[a][b] += 1
        return dict(out)

    def likely_next(self, current: str, heads: list[str], k: int = 2) -> list[str]:
        """The ``k`` heads most likely to follow ``current``."""
        after = self.transitions().get(current, collections.Counter())
        total = self.counts()
        order = {n: i for i, n in enumerate(heads)}
        return sorted((h for h in heads if h != current),
                      key=lambda h: (-after[h], -total[h], order[h]))[:k]


class HeadManager:
    """Swaps heads of one model atomically; a failing head raises HeadError."""

    def __init__(self, bundle: Bundle, model, head_params: dict[str, str], active: Head):
        self.bundle = bundle
        self.model = model
        self.head_params = head_params  # source tensor name -> model parameter path
        self.active = active
        self.usage = HeadUsage()
        self.usage.record(active.name)
        self.preloaded: dict[str, Head] = {}
        self.auto_k = 0
        self.last_swap: SwapStats | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyloader-heads")

    @property
    def current(self) -> str:
        return self.active.name

    def preload(self, names: Iterable[str], *, wait: bool = False, auto: bool = False) -> None:
        names = list(names)
        for n in names:
            self.bundle.entry(n)  # UnknownHeadError before anything starts
        for n in names:
            if n == self.current or n in self.preloaded:
                if n in self.preloaded and not auto:
                    self.preloaded[n].auto = False
                continue
            try:
                h = Head(self.bundle, n)
            except HeadError as exc:
                if not auto:
                    raise
                # The policy's guess is a hint: a bad head is reported when swapped to.
                log.warning("not preloading head %r: %s", n, exc)
                continue
            h.auto = auto
            h.future = self._pool.submit(h.bring_in)
            self.preloaded[n] = h
        if wait:
            for n in names:
                h = self.preloaded.get(n)
                if h is not None and h.future is not None:
                    h.future.result()

    def release_preloaded(self, names: Iterable[str] | None = None) -> None:
        for n in list(self.preloaded if names is None else names):
            h = self.preloaded.pop(n, None)
            if h is not None:
                if h.future is not None:
                    h.future.cancel()
                    with contextlib.suppress(Exception):  # a failed preload is just dropped
                        h.future.result()
                h.release()

    def set_auto_preload(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.auto_k = k
        self._apply_policy()

    def _apply_policy(self) -> None:
        want = set(self.usage.likely_next(self.current, self.bundle.names, self.auto_k)) \
            if self.auto_k else set()
        self.release_preloaded([n for n, h in self.preloaded.items() if h.auto and n not in want])
        if want:
            self.preload([n for n in want if n not in self.preloaded], auto=True)

    def swap(self, name: str) -> SwapStats:
        t0 = time.perf_counter()
        io0 = io_counters()
        previous = self.current
        if name == previous:
            self.usage.record(name)
            return SwapStats(name, previous, True, 0.0, self.active.nbytes, rchar=0,
                             read_bytes=0)
        self.bundle.entry(name)
        h = self.preloaded.get(name)
        warm = h is not None
        try:
            if h is None:
                h = Head(self.bundle, name)
            before = h.reader.stats()
            if not warm:
                h.bring_in()
            elif h.future is not None:
                h.future.result()  # raises the preload's HeadError
            self._check_model(h)
        except BaseException:
            if warm:
                self.release_preloaded([name])
            elif h is not None:
                h.release()
            raise
        self.preloaded.pop(name, None)
        self._commit(h)
        old, self.active = self.active, h
        self.usage.record(name)
        # The previous head stays in memory only if the policy expects it back.
        if self.auto_k and old.name in self.usage.likely_next(name, self.bundle.names,
                                                             self.auto_k):
            old.auto = True
            old.future = None
            self.preloaded[old.name] = old
        else:
            old.release()
        after = h.reader.stats()
        io = io_counters().since(io0)
        stats = SwapStats(
            name, previous, warm, time.perf_counter() - t0, h.nbytes,
            populate_bytes=after["populate_bytes"] - before["populate_bytes"],
            bytes_read=after["bytes_read"] - before["bytes_read"],
            rchar=io["rchar"], read_bytes=io["read_bytes"])
        self._apply_policy()  # background work, started after the measured swap
        self.last_swap = stats
        return stats

    def _check_model(self, h: Head) -> None:
        # The model's head parameters are exactly the active head's arrays.
        for src in self.head_params:
            if src not in h.arrays:
                raise HeadMismatchError("tensor missing from the head", head=h.name,
                                        file=h.file, tensor=src)
            a, cur = h.arrays[src], self.active.arrays[src]
            if a.shape != cur.shape or a.dtype != cur.dtype:
                kind = ("quantization" if src.endswith((".scales", ".biases"))
                        or str(cur.dtype) == "mlx.core.uint32" else "shape/dtype")
                raise HeadMismatchError(
                    f"{kind} mismatch: {a.dtype}{list(a.shape)} vs the model's "
                    f"{cur.dtype}{list(cur.shape)}", head=h.name, file=h.file, tensor=src)

    def _commit(self, h: Head) -> None:
        try:
            self.model.update(tree_unflatten(
                [(p, h.arrays[src]) for src, p in self.head_params.items()]))
        except BaseException:
            self.model.update(tree_unflatten(
                [(p, self.active.arrays[src]) for src, p in self.head_params.items()]))
            raise

    def close(self) -> None:
        self.release_preloaded()
        self._pool.shutdown(wait=True)


class HeadMethods:
    """Methods a bundle-loaded model gains (mixed into its class)."""

    def swap_head(self, name: str) -> SwapStats:
        """Replace the head by ``name``'s, atomically (HeadError keeps the previous head)."""
        return manager_of(self).swap(name)

    def preload_heads(self, names: Iterable[str], wait: bool = False) -> None:
        """Bring heads into memory in the background so that swapping to them reads nothing."""
        manager_of(self).preload(names, wait=wait)

    def release_preloaded_heads(self, names: Iterable[str] | None = None) -> None:
        """Drop preloaded heads (all when ``names`` is None)."""
        manager_of(self).release_preloaded(names)

    def auto_preload_heads(self, k: int = 2) -> None:
        """Keep the ``k`` heads most likely next preloaded after every swap; ``k=0``: off."""
        manager_of(self).set_auto_preload(k)

    @property
    def head_usage(self) -> HeadUsage:
        return manager_of(self).usage

    @property
    def current_head(self) -> str:
        return manager_of(self).current

    @property
    def head_names(self) -> list[str]:
        return manager_of(self).bundle.names

    @property
    def preloaded_heads(self) -> list[str]:
        return list(manager_of(self).preloaded)


def manager_of(model) -> HeadManager:
    """The head manager of a bundle-loaded model (ValueError for any other model)."""
    h = handle_of(model)
    if h is None or h.heads is None:
        raise ValueError("this model was not loaded from a head bundle")
    return h.heads


def _skeleton(bundle: Bundle, head_file: Path):
    """The mlx-lm model for the bundle's config with lazy, never-evaluated arrays."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    with tempfile.TemporaryDirectory(prefix="pyloader-heads-") as tmp:
        t = Path(tmp)
        for entry in bundle.path.iterdir():
            if entry.is_file() and entry.suffix != ".safetensors":
                (t / entry.name).symlink_to(entry.resolve())
        (t / "model-trunk.safetensors").symlink_to((bundle.path / TRUNK_FILE).resolve())
        (t / "model-head.safetensors").symlink_to(head_file.resolve())
        # strict=False: the padding entries are not parameters.
        model, _ = mlx_lm_load_model(t, lazy=True, strict=False)
    return model


class BundleLoad:
    """Loading a head bundle for :func:`pyloader.load_model`."""

    def __init__(self, path, head: str | None = None):
        self.bundle = Bundle(path)
        self.active = Head(self.bundle, head if head is not None else self.bundle.names[0])
        self.head_params: dict[str, str] = {}  # head tensor -> model parameter path

    @property
    def checkpoint(self) -> Checkpoint:
        """The trunk."""
        return self.bundle.trunk

    def skeleton(self):
        """The lazily built mlx-lm model with its active head, config checked first."""
        check_config(self.bundle.path)
        return _skeleton(self.bundle, Path(self.active.file))

    def tensors(self):
        """Metadata of the trunk's and the active head's tensors (for the source map)."""
        return self.bundle.trunk.tensors() + self.active.ckpt.tensors()

    def take_head(self, sources: SourceMap) -> tuple[SourceMap, dict[str, mx.array]]:
        """The trunk's part of ``sources``, and the head's arrays (read and verified now)."""
        if sources.derived:
            raise HeadError("the model's sanitize computes parameters "
                            f"({sorted(sources.derived)[:3]}...): bundles need checkpoints "
                            "saved by mlx-lm", file=str(self.bundle.path))
        head_srcs = set(self.active.names)
        self.head_params = {t.name: p for p, t in sources.direct.items() if t.name in head_srcs}
        self.active.bring_in()
        return (SourceMap({p: t for p, t in sources.direct.items() if t.name not in head_srcs}),
                {p: self.active.arrays[src] for src, p in self.head_params.items()})

    def finish(self, model) -> HeadManager:
        """Attach the head manager and its methods to the loaded model."""
        mgr = HeadManager(self.bundle, model, self.head_params, self.active)
        attach_handle(model).heads = mgr
        weakref.finalize(model, mgr._pool.shutdown, False)  # the pool, not mgr: no cycle
        add_mixin(model, HeadMethods)
        return mgr
