"""``load``: a checkpoint's tensors as ``dict[str, mx.array]``, with one of three strategies.

* ``"mmap"`` maps each file once.
* ``"pread"`` reads with a pool of threads into fresh MLX-owned buffers.
* ``"mlx"`` is plain ``mx.load`` (the baseline; its arrays are lazy).
See docs/loading.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import mlx.core as mx

from .._native import core
from .._util.memory import headroom_of, limiting_probe, read_memory
from .checkpoint import Checkpoint
from .gguf_header import is_gguf
from .readers import as_checkpoint, check_names, warn_misaligned

STRATEGIES = ("mmap", "pread", "mlx")
DEFAULT_STRATEGY = "mmap"


def check_fits(nbytes: int, what: str) -> None:
    """``MemoryError`` when ``nbytes`` of copies cannot fit this process's headroom."""
    snap = read_memory()
    avail = headroom_of(snap, page_cache="reclaimable")
    if avail is not None and nbytes > avail:
        raise MemoryError(
            f"{what}: the load copies {nbytes} bytes into memory but only {avail} bytes are "
            f"available ({limiting_probe(snap, page_cache='reclaimable')}); nothing was loaded. "
            "Use strategy='mmap' (zero-copy views) or stream the model (pyloader.load_model "
            "with resident < 1.0)")


@dataclass
class LoadStats:
    """What one load did."""

    strategy: str
    tensors: int = 0
    bytes: int = 0
    zero_copy_tensors: int = 0
    zero_copy_bytes: int = 0
    copied_tensors: int = 0
    copied_bytes: int = 0
    bytes_read: int = 0
    populate_bytes: int = 0
    buffer_reuses: int = 0
    buffer_misses: int = 0
    direct_bytes: int = 0
    failed_tensors: int = 0
    wall_s: float = 0.0
    zero_copy_verified: bool = True
    zero_copy_mode: str = ""

    @property
    def zero_copy_fraction(self) -> float:
        """Fraction of tensor bytes handed out without a copy."""
        return self.zero_copy_bytes / self.bytes if self.bytes else 1.0


def _load_mlx(ckpt: Checkpoint, names: list[str] | None) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in ckpt.files:
        if is_gguf(f):  # MLX's GGUF reader names, splits and converts tensors its own way
            raise ValueError(f"{f}: a GGUF file is read in place by the 'mmap' and 'pread' "
                             "strategies; strategy='mlx' (mx.load) reads safetensors only")
        out.update(mx.load(f))
    if names is not None:
        out = {n: out[n] for n in names}
    elif ckpt.padding_names:
        out = {n: a for n, a in out.items() if n not in ckpt.padding_names}
    return out


def load_with_stats(
    path,
    strategy: str = DEFAULT_STRATEGY,
    names: Iterable[str] | None = None,
    *,
    allow_misaligned: bool = False,
    threads: int | None = None,
    overlap: bool = False,
) -> tuple[dict[str, mx.array], LoadStats]:
    """Like :func:`load`, and also return the :class:`LoadStats` of this load."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    t0 = time.perf_counter()
    ckpt = as_checkpoint(path)
    wanted = check_names(ckpt, names)
    if strategy == "mlx":
        arrays = _load_mlx(ckpt, wanted)
        nbytes = sum(ckpt[n].nbytes for n in arrays)
        raw = {"tensors": len(arrays), "bytes": nbytes, "copied_tensors": len(arrays),
               "copied_bytes": nbytes, "bytes_read": nbytes}
    else:
        mmap = strategy == "mmap"
        if not (mmap and allow_misaligned):  # pread copies every tensor, mmap misaligned ones
            metas = [ckpt[n] for n in wanted] if wanted is not None else ckpt.tensors()
            check_fits(sum(t.nbytes for t in metas if not (mmap and t.aligned)), str(ckpt.path))
        if mmap and not allow_misaligned:
            warn_misaligned(ckpt)
        reader = (core.MmapReader(ckpt.index, allow_misaligned) if mmap
                  else core.PreadReader(ckpt.index, threads or 0))
        arrays = reader.load_overlapped(wanted) if overlap else reader.load(wanted)
        raw = reader.stats()
    stats = LoadStats(strategy=strategy, wall_s=time.perf_counter() - t0, **raw)
    return arrays, stats


def load(
    path,
    strategy: str = DEFAULT_STRATEGY,
    names: Iterable[str] | None = None,
    *,
    allow_misaligned: bool = False,
    threads: int | None = None,
    overlap: bool = False,
    return_metadata: bool = False,
):
    """Load a checkpoint's tensors as ``mx.array``s.

    Args:
        path: A ``.safetensors`` file, a model directory or an open :class:`Checkpoint`.
        strategy: ``"mmap"`` (default, zero-copy where aligned), ``"pread"`` or ``"mlx"``.
        names: Only these tensors (default: all).
        allow_misaligned: mmap only: view misaligned tensors instead of copying.
        threads: pread only: reader threads (default: one per core).
        overlap: Return at once, reading in file order in the background.
        return_metadata: Return ``(arrays, metadata)`` as ``mx.load`` does (shards merged).

    Raises:
        pyloader.FormatError: a header breaks a rule of the format.
        KeyError: an unknown name.
        FileNotFoundError / OSError: a file is missing or a read failed.
    """
    ckpt = as_checkpoint(path)
    arrays = load_with_stats(
        ckpt, strategy, names, allow_misaligned=allow_misaligned, threads=threads,
        overlap=overlap,
    )[0]
    return (arrays, ckpt.metadata()) if return_metadata else arrays
