"""Task heads over a resident trunk: bundles, hot swap, preload.

Fine-tuned variants of one base model often differ only in their last layers.
A *head bundle* stores the shared trunk once and each variant's head (the last
``tail`` decoder layers, the final norm and ``lm_head``) separately, all in
aligned safetensors files (:mod:`pyloader.repack`), so every tensor is a
zero-copy view of the page cache::

    OUT/
      config.json, tokenizer files ...   copied from the base
      trunk.safetensors                  everything but the heads; its
                                         __metadata__["pyloader.heads"] is the
                                         directory (JSON): tail, layers, per head
                                         its file, bytes and per-tensor dtype,
                                         shape and CRC-32
      heads/<name>.safetensors           one file per head

``build`` refuses variants whose trunk is not byte-identical to the base (the
first differing tensor is named) or whose configuration or quantization
differs. ``load_model(OUT, head="chat")`` returns the mlx-lm model with extra
methods: ``swap_head(name)`` replaces only the head's parameters (the trunk
arrays are the same objects before and after), atomically: every check runs
before the model is touched, and a failing head raises a :class:`HeadError`
with the model still on its previous head. ``preload_heads(names)`` brings
heads into memory on the reader's background worker (``MmapReader.prefetch``
with ``"populate"``) and verifies their checksums off the calling thread, so a
later swap to them reads nothing from disk.
"""

from __future__ import annotations

import collections
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
import time
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .checkpoint import Checkpoint, TensorMeta
from .loaders import MmapReader
from .repack import DEFAULT_ALIGN, _check_align, _remove, _tmp_sibling, commit, layer_of
from .repack import repack_file

log = logging.getLogger(__name__)

TRUNK_FILE = "trunk.safetensors"
HEADS_DIR = "heads"
META_HEADS = "pyloader.heads"
META_HEAD = "pyloader.head"
FORMAT_VERSION = 1
_CHUNK = 16 << 20  # bring_in: bytes read per step (CRC overlaps the next reads)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Non-layer tensors that come after the decoder layers.
_FINAL_RE = re.compile(r"(?:^|\.)(?:norm|final_layernorm|ln_f|lm_head)\.")
# Config keys that describe where a checkpoint came from, not what it computes.
_INFO_KEYS = {"_name_or_path", "transformers_version", "pyloader_gguf_source", "architectures",
              "torch_dtype", "quantization_config"}


# ----------------------------------------------------------------------------
# Errors


class HeadError(Exception):
    """A head cannot be built or swapped in; the model keeps its previous head.

    Attributes: ``head`` (name), ``file`` and ``tensor`` (None when the rule
    is not about one file or tensor).
    """

    def __init__(self, message: str, *, head: str | None = None, file: str | None = None,
                 tensor: str | None = None):
        parts = [p for p in (f"head {head!r}" if head else None, file,
                             f"tensor {tensor!r}" if tensor else None) if p]
        super().__init__(f"{': '.join(parts)}: {message}" if parts else message)
        self.head, self.file, self.tensor = head, file, tensor


class UnknownHeadError(HeadError, KeyError):
    """The bundle has no head of that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class HeadMismatchError(HeadError, ValueError):
    """A head's tensors do not match the bundle's directory or the model:
    missing or extra tensors, shape, dtype or quantization."""


class HeadChecksumError(HeadMismatchError):
    """A head tensor's bytes do not match the CRC-32 stored in the bundle."""


class TrunkMismatchError(HeadError, ValueError):
    """``build``: a variant's trunk differs from the base's."""


class HeadIOError(HeadError, OSError):
    """A head file could not be opened, parsed or read."""


# ----------------------------------------------------------------------------
# Which tensors are the head


def num_layers(names: Iterable[str]) -> int:
    """Decoder layers in a checkpoint (highest layer index + 1)."""
    idx = [i for i in map(layer_of, names) if i is not None]
    return max(idx) + 1 if idx else 0


def is_head_tensor(name: str, layers: int, tail: int) -> bool:
    """The tensor belongs to the head: one of the last ``tail`` layers, or a
    non-layer final norm / ``lm_head`` tensor."""
    i = layer_of(name)
    if i is not None:
        return i >= layers - tail
    return _FINAL_RE.search(name) is not None


def _config(path: Path) -> dict:
    p = (path if path.is_dir() else path.parent) / "config.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _config_diff(base: dict, other: dict) -> str | None:
    keys = sorted((set(base) | set(other)) - _INFO_KEYS)
    for k in keys:
        if base.get(k) != other.get(k):
            return k
    return None


def _crc_file(path: str, metas: list[TensorMeta]) -> dict[str, int]:
    """CRC-32 of each tensor's bytes, read through a read-only mapping."""
    out = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return {t.name: 0 for t in metas}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as mv:
            for t in metas:
                with mv[t.offset:t.offset + t.nbytes] as part:
                    out[t.name] = zlib.crc32(part)
    return out


# ----------------------------------------------------------------------------
# Building


@dataclass
class BuildResult:
    """What :func:`build` wrote."""

    path: str
    tail: int
    layers: int
    trunk_tensors: int
    trunk_bytes: int
    heads: dict[str, int] = field(default_factory=dict)  # name -> head bytes


def _first_difference(base: Checkpoint, other: Checkpoint, names: list[str]) -> str | None:
    """The first tensor (in layer order) whose bytes differ, or None."""
    files: dict[str, Any] = {}
    views: dict[str, memoryview] = {}

    def view(path: str) -> memoryview:
        if path not in views:
            f = open(path, "rb")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            files[path] = (f, mm)
            views[path] = memoryview(mm)
        return views[path]

    try:
        for n in names:
            a, b = base[n], other[n]
            if a.dtype != b.dtype or a.shape != b.shape:
                return n
            if a.nbytes and view(a.file)[a.offset:a.offset + a.nbytes] != \
                    view(b.file)[b.offset:b.offset + b.nbytes]:
                return n
        return None
    finally:
        for v in views.values():
            v.release()
        for f, mm in files.values():
            mm.close()
            f.close()


def build(base: str | os.PathLike[str], heads: dict[str, str | os.PathLike[str]], tail: int,
          out: str | os.PathLike[str], *, align: int = DEFAULT_ALIGN,
          overwrite: bool = False) -> BuildResult:
    """Build a head bundle.

    Args:
        base: The base model directory; its trunk is stored once.
        heads: Head name → model directory of a variant (the base itself may
            be one of them).
        tail: Decoder layers in each head (the last ``tail``); the final norm
            and ``lm_head`` are always part of the head.
        out: Bundle directory to write (atomically: under a temporary name,
            renamed when complete).
        align: Boundary of every tensor (see :mod:`pyloader.repack`).
        overwrite: Replace an existing ``out``.

    Raises:
        TrunkMismatchError: a variant's trunk tensor differs from the base's
            (the first one is named), or its tensor names differ.
        HeadMismatchError: a variant's configuration or quantization (bits,
            group size, dtype of a head tensor) differs from the base's.
        ValueError: bad head names or ``tail``.
    """
    _check_align(align)
    base_p, out_p = Path(base), Path(out)
    if not heads:
        raise ValueError("a bundle needs at least one head")
    for name in heads:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"invalid head name {name!r} (letters, digits, '_', '-', '.')")
    base_ck = Checkpoint(base_p)
    names = base_ck.keys()
    layers = num_layers(names)
    if isinstance(tail, bool) or not isinstance(tail, int) or not 1 <= tail <= layers:
        raise ValueError(f"tail must be between 1 and the model's {layers} layers, got {tail!r}")
    head_names = sorted((n for n in names if is_head_tensor(n, layers, tail)),
                        key=_order_key)
    trunk_names = sorted((n for n in names if n not in set(head_names)), key=_order_key)
    base_cfg = _config(base_p)

    variants: dict[str, Checkpoint] = {}
    for name, src in heads.items():
        ck = Checkpoint(src)
        missing = sorted(set(names) - set(ck.keys()), key=_order_key)
        extra = sorted(set(ck.keys()) - set(names), key=_order_key)
        if missing or extra:
            bad = (missing or extra)[0]
            raise TrunkMismatchError(
                f"tensor {'missing from' if missing else 'not in the base, found in'} "
                f"the variant ({len(missing)} missing, {len(extra)} extra)",
                head=name, file=str(src), tensor=bad)
        key = _config_diff(base_cfg, _config(Path(src)))
        if key is not None:
            what = "quantization" if key == "quantization" else "configuration"
            raise HeadMismatchError(
                f"{what} differs from the base's (config.json key {key!r}: "
                f"{base_cfg.get(key)!r} vs {_config(Path(src)).get(key)!r})",
                head=name, file=str(src))
        for n in head_names:
            a, b = base_ck[n], ck[n]
            if a.dtype != b.dtype or a.shape != b.shape:
                raise HeadMismatchError(
                    f"dtype/shape {b.dtype}{list(b.shape)} differs from the base's "
                    f"{a.dtype}{list(a.shape)} (quantization bits or group size, or dtype)",
                    head=name, file=b.file, tensor=n)
        diff = _first_difference(base_ck, ck, trunk_names)
        if diff is not None:
            raise TrunkMismatchError(
                "trunk tensor differs from the base's (every tensor outside the last "
                f"{tail} layers, the final norm and lm_head must be byte-identical)",
                head=name, file=ck[diff].file, tensor=diff)
        variants[name] = ck

    if (out_p.exists() or out_p.is_symlink()) and not overwrite:
        raise FileExistsError(17, "destination exists (pass overwrite=True)", str(out_p))
    out_p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out_p, "tmp")
    _remove(tmp)
    try:
        tmp.mkdir()
        (tmp / HEADS_DIR).mkdir()
        directory: dict[str, Any] = {
            "version": FORMAT_VERSION, "tail": tail, "layers": layers, "align": align,
            "quantization": base_cfg.get("quantization"), "heads": {}}
        result = BuildResult(str(out_p), tail, layers, len(trunk_names),
                             sum(base_ck[n].nbytes for n in trunk_names))
        for name, ck in variants.items():
            rel = f"{HEADS_DIR}/{name}.safetensors"
            repack_file(ck, ck.files[0], tmp / rel, align, 0,
                        extra_metadata={META_HEAD: name}, names=head_names)
            written = Checkpoint(tmp / rel)
            metas = [written[n] for n in head_names]
            crcs = _crc_file(str(tmp / rel), metas)
            directory["heads"][name] = {
                "file": rel, "source": os.path.abspath(os.fspath(heads[name])),
                "bytes": sum(t.nbytes for t in metas),
                "tensors": {t.name: {"dtype": t.dtype, "shape": list(t.shape),
                                     "crc32": crcs[t.name]} for t in metas}}
            result.heads[name] = directory["heads"][name]["bytes"]
        repack_file(base_ck, base_ck.files[0], tmp / TRUNK_FILE, align, 0,
                    extra_metadata={META_HEADS: json.dumps(directory, separators=(",", ":"))},
                    names=trunk_names)
        src_dir = base_p if base_p.is_dir() else base_p.parent
        for entry in sorted(src_dir.iterdir()):
            if (entry.is_file() and entry.suffix != ".safetensors"
                    and entry.name != "model.safetensors.index.json"):
                shutil.copy2(entry, tmp / entry.name)
        commit(tmp, out_p, overwrite)
    except BaseException:
        _remove(tmp)
        raise
    return result


def _order_key(name: str):
    from .repack import layer_order

    return layer_order(name)


# ----------------------------------------------------------------------------
# Reading a bundle


def is_bundle(path: str | os.PathLike[str]) -> bool:
    """``path`` is a head bundle directory (cheap: two stat calls)."""
    p = Path(path)
    return (p / TRUNK_FILE).is_file() and (p / HEADS_DIR).is_dir()


class Bundle:
    """A head bundle's trunk checkpoint and directory of heads."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        trunk_file = self.path / TRUNK_FILE
        self.trunk = Checkpoint(trunk_file)
        raw = self.trunk.metadata().get(META_HEADS)
        if raw is None:
            raise HeadError(f"no {META_HEADS!r} directory in the metadata: not a head bundle",
                            file=str(trunk_file))
        try:
            d = json.loads(raw)
            self.tail = int(d["tail"])
            self.layers = int(d["layers"])
            self.heads: dict[str, dict] = dict(d["heads"])
            self.quantization = d.get("quantization")
            if d.get("version") != FORMAT_VERSION:
                raise ValueError(f"version {d.get('version')!r}, expected {FORMAT_VERSION}")
            for name, e in self.heads.items():
                if not _NAME_RE.fullmatch(name) or e["file"] != f"{HEADS_DIR}/{name}.safetensors":
                    raise ValueError(f"bad entry for head {name!r}")
                for t in e["tensors"].values():
                    t["shape"] = tuple(int(x) for x in t["shape"])
                    t["crc32"] = int(t["crc32"])
        except (ValueError, KeyError, TypeError) as exc:
            raise HeadError(f"malformed heads directory in the metadata: {exc}",
                            file=str(trunk_file)) from exc
        if not self.heads:
            raise HeadError("the bundle has no heads", file=str(trunk_file))

    @property
    def names(self) -> list[str]:
        return list(self.heads)

    def entry(self, name: str) -> dict:
        if name not in self.heads:
            raise UnknownHeadError(f"no such head; the bundle has {self.names}", head=name)
        return self.heads[name]

    def head_file(self, name: str) -> Path:
        return self.path / self.entry(name)["file"]

    def head_tensors(self) -> list[str]:
        """Tensor names every head holds (the same for all heads)."""
        return list(next(iter(self.heads.values()))["tensors"])


# ----------------------------------------------------------------------------
# A head in memory


@dataclass
class SwapStats:
    """One swap: its time, whether the head was preloaded, and the I/O it did.

    ``populate_bytes`` and ``bytes_read`` are the head reader's counters
    during the swap (bytes read in by prefetch/populate, and copied); ``rchar``
    and ``read_bytes`` are this process's ``/proc/self/io`` counters (bytes
    read by system calls; bytes fetched from storage).
    """

    head: str
    previous: str
    warm: bool
    seconds: float
    head_bytes: int
    populate_bytes: int = 0
    bytes_read: int = 0
    rchar: int = -1
    read_bytes: int = -1


def _proc_io() -> dict[str, int]:
    """``/proc/self/io`` counters; ``rchar`` excludes this read itself (the
    bytes of the file are counted once it has been read)."""
    try:
        with open("/proc/self/io", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {k: int(v) for k, v in (line.split(b": ") for line in raw.splitlines())}
    out = {k.decode(): v for k, v in out.items()}
    out["_self"] = len(raw)
    return out


class _Head:
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
        have = set(self.ckpt.keys())
        for n in want:
            if n not in have:
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
        """Read the head's pages in (populate), create its zero-copy arrays and
        verify every checksum over them. Raises HeadError (and keeps no
        arrays); safe on any thread.

        The head is read in chunks of about ``_CHUNK`` bytes, all queued on the
        reader's worker at once: the CRC of one chunk runs while the next ones
        are being read."""
        chunks: list[list[str]] = [[]]
        size = 0
        for n in self.names:
            if size >= _CHUNK:
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
                # The CRC reads the very pages the model will use (zlib
                # releases the GIL).
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
        """Drop this head's arrays and the reader's mappings (a mapping is
        unmapped once no array uses it)."""
        if self.future is not None:
            self.future.cancel()
        self.arrays = None
        self.reader.close()


# ----------------------------------------------------------------------------
# Usage history and the preload policy


@dataclass
class HeadUsage:
    """Which heads were active, in order: ``history`` holds ``(time.time(),
    name)`` for the initial head and every swap."""

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
        """The ``k`` heads most likely to follow ``current``: by how often they
        followed it, then by overall use, then in directory order."""
        after = self.transitions().get(current, collections.Counter())
        total = self.counts()
        order = {n: i for i, n in enumerate(heads)}
        cands = [h for h in heads if h != current]
        cands.sort(key=lambda h: (-after[h], -total[h], order[h]))
        return cands[:k]


# ----------------------------------------------------------------------------
# The manager attached to a model


class HeadManager:
    """Swaps heads of one model; see the module docstring."""

    def __init__(self, bundle: Bundle, model, head_params: dict[str, str], active: _Head):
        self.bundle = bundle
        self.model = model
        self.head_params = head_params  # source tensor name -> model parameter path
        self.active = active
        self.usage = HeadUsage()
        self.usage.record(active.name)
        self.preloaded: dict[str, _Head] = {}
        self.auto_k = 0
        self.last_swap: SwapStats | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyloader-heads")

    @property
    def current(self) -> str:
        return self.active.name

    # -- preload ----------------------------------------------------------------

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
                h = _Head(self.bundle, n)
            except HeadError as exc:
                if not auto:
                    raise
                # The policy's guess is only a hint: a bad head is reported
                # when (if ever) it is swapped to.
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
                    try:
                        h.future.result()
                    except Exception:  # noqa: BLE001 - a failed preload is just dropped
                        pass
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

    # -- swap -------------------------------------------------------------------

    def swap(self, name: str) -> SwapStats:
        t0 = time.perf_counter()
        io0 = _proc_io()
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
                h = _Head(self.bundle, name)
                before = h.reader.stats()
                h.bring_in()
            else:
                before = h.reader.stats()
                if h.future is not None:
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
        # The previous head: kept in memory if the policy expects it back
        # soon, else its arrays and mappings are released.
        if self.auto_k and old.name in self.usage.likely_next(name, self.bundle.names,
                                                             self.auto_k):
            old.auto = True
            old.future = None
            self.preloaded[old.name] = old
        else:
            old.release()
        after = h.reader.stats()
        io1 = _proc_io()
        stats = SwapStats(
            name, previous, warm, time.perf_counter() - t0, h.nbytes,
            populate_bytes=after["populate_bytes"] - before["populate_bytes"],
            bytes_read=after["bytes_read"] - before["bytes_read"],
            rchar=io1.get("rchar", 0) - io0.get("rchar", 0) - io0["_self"] if io0 else -1,
            read_bytes=io1.get("read_bytes", 0) - io0.get("read_bytes", 0) if io0 else -1)
        self._apply_policy()  # background work, started after the measured swap
        self.last_swap = stats
        return stats

    def _check_model(self, h: _Head) -> None:
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

    def _commit(self, h: _Head) -> None:
        from mlx.utils import tree_unflatten

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


class _HeadMethods:
    """Methods a bundle-loaded model gains (mixed into its class)."""

    def swap_head(self, name: str) -> SwapStats:
        """Replace the head by ``name``'s, atomically (raises HeadError and
        keeps the previous head on any failure)."""
        return self._pyloader_heads.swap(name)

    def preload_heads(self, names: Iterable[str], wait: bool = False) -> None:
        """Bring heads into memory in the background (page-cache populate and
        checksum), so that swapping to them reads nothing from disk."""
        self._pyloader_heads.preload(names, wait=wait)

    def release_preloaded_heads(self, names: Iterable[str] | None = None) -> None:
        """Drop preloaded heads (all when ``names`` is None)."""
        self._pyloader_heads.release_preloaded(names)

    def auto_preload_heads(self, k: int = 2) -> None:
        """Policy: after every swap keep the ``k`` heads most likely to come
        next (from :attr:`head_usage`) preloaded; ``k=0`` turns it off."""
        self._pyloader_heads.set_auto_preload(k)

    @property
    def head_usage(self) -> HeadUsage:
        return self._pyloader_heads.usage

    @property
    def current_head(self) -> str:
        return self._pyloader_heads.current

    @property
    def head_names(self) -> list[str]:
        return self._pyloader_heads.bundle.names

    @property
    def preloaded_heads(self) -> list[str]:
        return list(self._pyloader_heads.preloaded)


_HEADED: dict[type, type] = {}


def _headed_class(cls: type) -> type:
    sub = _HEADED.get(cls)
    if sub is None:
        sub = type(f"Headed{cls.__name__}", (_HeadMethods, cls),
                   {"__doc__": cls.__doc__, "__module__": cls.__module__})
        _HEADED[cls] = sub
    return sub


class _Metas:
    """Duck-typed stand-in for a Checkpoint in ``streaming._source_map``."""

    def __init__(self, metas: list[TensorMeta]):
        self._metas = metas

    def tensors(self) -> list[TensorMeta]:
        return self._metas


def _skeleton(bundle: Bundle, head_file: Path):
    """The mlx-lm model for the bundle's config (quantized like the
    checkpoint), its lazy arrays never evaluated: mlx-lm sees the trunk and one
    head as a two-file model directory of symlinks."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    with tempfile.TemporaryDirectory(prefix="pyloader-heads-") as tmp:
        t = Path(tmp)
        for entry in bundle.path.iterdir():
            if entry.is_file() and entry.suffix != ".safetensors":
                (t / entry.name).symlink_to(entry.resolve())
        (t / "model-trunk.safetensors").symlink_to((bundle.path / TRUNK_FILE).resolve())
        (t / "model-head.safetensors").symlink_to(head_file.resolve())
        # strict=False: the padding entries are not parameters. pyloader's
        # strict load_weights below checks every parameter.
        model, _ = mlx_lm_load_model(t, lazy=True, strict=False)
    return model


def load_model(path: str | os.PathLike[str], *, head: str | None = None,
               resident: Any = 1.0, tokenizer: bool = True):
    """Load a head bundle's model with ``head`` (default: the first) in place.

    Called by :func:`pyloader.load_model` for bundle directories. Every
    tensor is a zero-copy view (the bundle is aligned); the trunk's pages are
    read in at load.

    Returns:
        ``(model, tokenizer)``; the model has ``swap_head``, ``preload_heads``,
        ``auto_preload_heads``, ``release_preloaded_heads``, ``head_usage``,
        ``current_head``, ``head_names`` and ``preloaded_heads``.
    """
    from mlx_lm.utils import load_tokenizer

    from .streaming import _has_tokenizer, _source_map

    if resident != 1.0:
        raise ValueError("head bundles load fully resident (resident=1.0)")
    bundle = Bundle(path)
    name = head if head is not None else bundle.names[0]
    active = _Head(bundle, name)
    model = _skeleton(bundle, Path(active.file))
    metas = bundle.trunk.tensors() + active.ckpt.tensors()
    direct, derived = _source_map(model, _Metas(metas))
    if derived:
        raise HeadError("the model's sanitize computes parameters "
                        f"({sorted(derived)[:3]}...): bundles need checkpoints saved by mlx-lm",
                        file=str(bundle.path))
    head_srcs = set(active.names)
    head_params = {src: p for p, src in direct.items() if src in head_srcs}
    trunk_params = {p: src for p, src in direct.items() if src not in head_srcs}

    trunk_reader = MmapReader(bundle.trunk)
    srcs = list(dict.fromkeys(trunk_params.values()))
    trunk_reader.wait(trunk_reader.prefetch(srcs, "populate"))
    trunk = trunk_reader.load(srcs)
    active.bring_in()
    weights = [(p, trunk[src]) for p, src in trunk_params.items()]
    weights += [(p, active.arrays[src]) for src, p in head_params.items()]
    model.load_weights(weights, strict=True)
    del weights, trunk
    trunk_reader.close()  # the arrays keep the mapping

    mgr = HeadManager(bundle, model, head_params, active)
    object.__setattr__(model, "_pyloader_heads", mgr)
    weakref.finalize(model, mgr._pool.shutdown, False)
    model.__class__ = _headed_class(type(model))
    tok = load_tokenizer(bundle.path) if tokenizer and _has_tokenizer(bundle.path) else None
    return model, tok
