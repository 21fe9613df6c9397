"""Where the pread reader's time goes, and what fewer page faults would buy.

    python bench/fault_emulation.py [CHECKPOINT] [--reps 3] [--cache warm|cold]

Replays PreadReader's work in plain Python (the reads release the GIL): one
``malloc(nbytes + 8)`` per tensor as MLX's CPU allocator does, 16 MiB chunks
sorted by file offset, read by a pool of ``--threads`` threads. Each variant
runs in a fresh process:

* ``plain``: what PreadReader does today. Every 4 KiB destination page is
  first touched inside ``pread``'s copy, so the copy pays one page fault each.
* ``prefaulted``: the destinations are faulted in first, untimed: the cost of
  the copy alone (the floor for any reader that fills fresh buffers).
* ``populate``: ``madvise(MADV_POPULATE_WRITE)`` on each chunk's destination
  before its ``pread`` (Linux 5.14+): the same faults without the trap per page.
* ``thp``: ``madvise(MADV_HUGEPAGE)`` + ``MADV_POPULATE_WRITE`` per chunk: 2 MiB
  pages where the buffer covers them, 512x fewer faults.
* ``thp-nopopulate``: ``MADV_HUGEPAGE`` alone (huge faults inside the copy).

Linux x86-64/arm64 only (madvise numbers are Linux's).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
PAGE = os.sysconf("SC_PAGE_SIZE")
VARIANTS = ("plain", "prefaulted", "populate", "thp", "thp-nopopulate")


def _run_one(path: str, variant: str, threads: int, chunk: int, cache: str) -> None:
    from pyloader import io as pio

    libc = ctypes.CDLL(None, use_errno=True)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ckpt = pio.open(path)
    tensors = ckpt.tensors()
    if cache == "cold":
        for f in ckpt.files:
            pio.evict_file(f)
    else:
        for f in ckpt.files:
            with open(f, "rb") as fh:
                while fh.read(8 << 20):
                    pass
    fd = os.open(path, os.O_RDONLY)

    def advise(a: int, n: int, advice: int) -> None:
        lo, hi = (a + PAGE - 1) // PAGE * PAGE, (a + n) // PAGE * PAGE
        if hi > lo and libc.madvise(lo, hi - lo, advice) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({advice})")

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    jobs = []
    for t in tensors:
        dst = libc.malloc(t.nbytes + 8) + 8  # MLX: 8-byte size header, then data
        if variant == "prefaulted":
            ctypes.memset(dst, 0, t.nbytes)
        jobs += [(t.offset + d, dst + d, min(chunk, t.nbytes - d))
                 for d in range(0, t.nbytes, chunk)]
    jobs.sort()
    if variant == "prefaulted":
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()

    def work(job):
        off, dst, n = job
        if variant in ("thp", "thp-nopopulate"):
            advise(dst, n, MADV_HUGEPAGE)
        if variant in ("thp", "populate"):
            advise(dst, n, MADV_POPULATE_WRITE)
        mv = memoryview((ctypes.c_char * n).from_address(dst)).cast("B")
        got = 0
        while got < n:
            got += os.preadv(fd, [mv[got:]], off + got)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, jobs))
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{t:.4f} {r1.ru_stime - r0.ru_stime:.3f} {r1.ru_minflt - r0.ru_minflt}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--cache", choices=("warm", "cold"), default="warm")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant here
    args = p.parse_args(argv)
    if args.checkpoint is None:
        from benchlib.synthetic import synthetic_pair

        args.checkpoint = synthetic_pair()["safetensors"]
    chunk = args.chunk_mib << 20
    if args.one:
        _run_one(args.checkpoint, args.one, args.threads, chunk, args.cache)
        return 0
    variants = args.variants.split(",")
    res: dict[str, list[tuple[float, float, int]]] = {v: [] for v in variants}
    for rep in range(args.reps):
        for v in variants:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), args.checkpoint, "--one", v,
                 "--threads", str(args.threads), "--chunk-mib", str(args.chunk_mib),
                 "--cache", args.cache], capture_output=True, text=True, check=True).stdout
            t, st, flt = out.split()
            res[v].append((float(t), float(st), int(flt)))
            print(f"  rep {rep + 1} {v}: {float(t):.3f} s", file=sys.stderr, flush=True)
    size = os.path.getsize(args.checkpoint)
    print(f"{args.checkpoint} ({size / 2**30:.2f} GiB), {args.cache}, {args.threads} threads, "
          f"{args.chunk_mib} MiB chunks, {args.reps} reps")
    print(f"{'variant':<16} {'median s':>8} {'min':>7} {'max':>7} {'GB/s':>6} {'stime':>6} "
          f"{'minflt':>8}")
    for v, rs in res.items():
        ts = [r[0] for r in rs]
        med = statistics.median(ts)
        print(f"{v:<16} {med:8.3f} {min(ts):7.3f} {max(ts):7.3f} {size / med / 1e9:6.2f} "
              f"{statistics.median(r[1] for r in rs):6.2f} "
              f"{int(statistics.median(r[2] for r in rs)):8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
