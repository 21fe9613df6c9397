"""The ``load`` workload: one checkpoint into arrays with one strategy. See docs/compare.md."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import resource
import time

import mlx.core as mx

from ..._util.host import process_memory
from ...io.checkpoint import Checkpoint
from ...io.pagecache import warm
from ...io.readers import PreadReader
from ...io.strategies import load_with_stats

STRATEGIES = ("mlx", "pread", "mmap", "safetensors")
#: Bounds a loader is judged against: plain, parallel and direct-I/O reads.
BOUNDS = ("read", "read-parallel", "read-direct")
HUGE = 2 << 20
READ_BUFFER = 16 << 20
PARALLEL_CHUNK = 2 << 20
PHASES = ("dict", "read_all")


def _usage() -> dict[str, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"utime": r.ru_utime, "stime": r.ru_stime, "minflt": r.ru_minflt,
            "majflt": r.ru_majflt, "nivcsw": r.ru_nivcsw}


def _snapshot(anon_ready: int | None) -> dict[str, int | None]:
    s = process_memory()
    return {
        "peak_rss": s.peak_rss,
        "rss": s.rss,
        "rss_anon": s.rss_anon,
        "rss_file": s.rss_file,
        "anon_delta": (s.rss_anon - anon_ready
                       if s.rss_anon is not None and anon_ready is not None else None),
        "mx_peak": mx.get_peak_memory(),
        "mx_active": mx.get_active_memory(),
    }


def _delta(after: dict, before: dict) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def _open_direct(path: str) -> int:
    """A descriptor of ``path`` whose reads bypass the page cache; OSError where none."""
    if hasattr(os, "O_DIRECT"):
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)  # macOS
    except (AttributeError, OSError):
        os.close(fd)
        raise OSError(f"no direct reads on this platform for {path}") from None
    return fd


def _aligned_buffer(size: int) -> tuple[mmap.mmap, memoryview]:
    """A 2 MiB-aligned view of ``size`` bytes of an anonymous mapping (huge pages if possible)."""
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = (-base) % HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE, start, size)
    return m, memoryview(m)[start:start + size]


def _read_bound(files: list[str], *, parallel: bool, threads: int | None,
                direct: bool = False) -> int:
    """Bytes read by the ``read``, ``read-parallel`` or ``read-direct`` bound."""
    if not parallel:
        warm(files, chunk=READ_BUFFER)  # read() start to end into one reused buffer
        return sum(os.path.getsize(f) for f in files)
    from concurrent.futures import ThreadPoolExecutor

    width = threads or os.cpu_count() or 1
    jobs = []
    fds = [_open_direct(f) if direct else os.open(f, os.O_RDONLY) for f in files]
    try:
        for fd in fds:
            size = os.fstat(fd).st_size
            jobs += [(fd, off, min(PARALLEL_CHUNK, size - off))
                     for off in range(0, size, PARALLEL_CHUNK)]

        def worker(k: int) -> int:
            keep, view = (_aligned_buffer(PARALLEL_CHUNK) if direct
                          else (None, memoryview(bytearray(PARALLEL_CHUNK))))
            done = 0
            for fd, off, length in jobs[k::width]:
                # Direct reads ask for whole 4 KiB blocks; the file's end cuts the last.
                ask = -(-length // 4096) * 4096 if direct else length
                done += min(os.preadv(fd, [view[:ask]], off), length)  # releases the GIL
            del keep
            return done

        with ThreadPoolExecutor(width) as pool:
            return sum(pool.map(worker, range(width)))
    finally:
        for fd in fds:
            os.close(fd)


def _load(strategy: str, path: str, files: list[str], threads: int | None,
          chunk_bytes: int | None, allow_misaligned: bool = False,
          backend: str | None = None):
    """(arrays, stats dict) for one strategy; arrays are materialized."""
    if strategy in BOUNDS:
        n = _read_bound(files, parallel=strategy != "read", threads=threads,
                        direct=strategy == "read-direct")
        return {}, {"tensors": 0, "bytes": n, "zero_copy_tensors": 0, "zero_copy_bytes": 0,
                    "copied_tensors": 0, "copied_bytes": 0, "bytes_read": n,
                    "zero_copy_verified": True}
    if strategy in ("mlx", "safetensors"):
        arrays = {}
        for f in files:
            if strategy == "mlx":
                arrays.update(mx.load(f))
                continue
            from safetensors import safe_open

            with safe_open(f, framework="mlx") as so:  # not iterable: keys() it is
                arrays.update({k: so.get_tensor(k) for k in so.keys()})  # noqa: SIM118
        mx.eval(list(arrays.values()))
        return arrays, None
    if strategy == "pread" and (chunk_bytes or backend):
        reader = PreadReader(path, threads=threads, chunk_bytes=chunk_bytes,
                             **({"backend": backend} if backend else {}))
        return reader.load(), reader.stats()
    arrays, stats = load_with_stats(path, strategy, threads=threads,
                                    allow_misaligned=allow_misaligned)
    return arrays, {k: getattr(stats, k) for k in (
        "tensors", "bytes", "zero_copy_tensors", "zero_copy_bytes", "copied_tensors",
        "copied_bytes", "bytes_read", "zero_copy_verified")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint (file or directory)")
    p.add_argument("--strategy", required=True, choices=STRATEGIES + BOUNDS)
    p.add_argument("--stop-after", choices=PHASES, default="read_all")
    p.add_argument("--threads", type=int, default=None, help="pread reader threads")
    p.add_argument("--chunk-bytes", type=int, default=None, help="pread chunk size")
    p.add_argument("--backend", choices=("threads", "io_uring"), default=None,
                   help="pread reader backend")
    p.add_argument("--allow-misaligned", action="store_true",
                   help="mmap: view misaligned tensors instead of copying them")


def prepare(args: argparse.Namespace) -> tuple[dict, dict]:
    if args.strategy == "safetensors":
        import safetensors  # noqa: F401 - fail before "ready", not in the timed part
        with contextlib.suppress(ImportError):
            import ml_dtypes  # noqa: F401 - lets safetensors hand out bfloat16
    ckpt = Checkpoint(args.path)
    files = list(ckpt.files)
    state = {"files": files, "bytes": ckpt.total_nbytes, "tensors": len(ckpt)}
    del ckpt
    mx.eval(mx.max(mx.zeros((16,), dtype=mx.uint16)))  # start MLX's CPU stream now
    mx.reset_peak_memory()
    state["anon_ready"] = process_memory().rss_anon  # None where not reported
    return {"pid": os.getpid(), "files": files, "bytes": state["bytes"],
            "tensors": state["tensors"], "rss_anon_ready": state["anon_ready"]}, state


def run(args: argparse.Namespace, state: dict) -> dict:
    """Load, then read every byte (the arrays stay in ``state`` until the result is out)."""
    anon_ready = state["anon_ready"]
    total, n_tensors = state["bytes"], state["tensors"]
    u0 = _usage()
    t0 = time.perf_counter()
    arrays, stats = _load(args.strategy, args.path, state["files"], args.threads,
                          args.chunk_bytes, args.allow_misaligned, args.backend)
    state["arrays"] = arrays
    t_dict = time.perf_counter() - t0
    u1 = _usage()
    result = {
        "strategy": args.strategy,
        "path": args.path,
        "bytes": total,
        "tensors": n_tensors,
        "t_dict": t_dict,
        "dict": _snapshot(anon_ready),
        "usage_dict": _delta(u1, u0),
        "rss_anon_ready": anon_ready,
    }
    if stats is None:  # mx.load and safetensors copy every byte
        stats = {"tensors": n_tensors, "bytes": total, "zero_copy_tensors": 0,
                 "zero_copy_bytes": 0, "copied_tensors": n_tensors, "copied_bytes": total,
                 "bytes_read": total, "zero_copy_verified": True}
    stats["zero_copy_fraction"] = (stats["zero_copy_bytes"] / stats["bytes"]
                                   if stats["bytes"] and stats["tensors"] else 1.0)
    result["stats"] = stats
    if args.stop_after == "read_all":
        # every byte read: a max over an unsigned view of each tensor, evaluated once
        uint = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
        mx.eval([mx.max(a.view(uint[a.itemsize])) for a in arrays.values() if a.size])
        result["t_read_all"] = time.perf_counter() - t0
        result["read_all"] = _snapshot(anon_ready)
        result["usage_read_all"] = _delta(_usage(), u1)
    return result
