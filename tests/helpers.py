"""Helpers shared by the tests: dtype table, hand-written safetensors files, launching
two ranks on loopback."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import random
import socket
import struct
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest


# Every dtype MLX has an array type for, as (safetensors name, mlx dtype).
MLX_DTYPES = [
    ("BOOL", mx.bool_),
    ("U8", mx.uint8),
    ("I8", mx.int8),
    ("U16", mx.uint16),
    ("I16", mx.int16),
    ("U32", mx.uint32),
    ("I32", mx.int32),
    ("U64", mx.uint64),
    ("I64", mx.int64),
    ("F16", mx.float16),
    ("BF16", mx.bfloat16),
    ("F32", mx.float32),
]


def fuzz_seed() -> int:
    """A fuzz run's seed: ``PYLOADER_FUZZ_SEED`` when set (to replay a failure), else a
    new one."""
    env = os.environ.get("PYLOADER_FUZZ_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 32)


def random_array(rng: np.random.Generator, dtype: mx.Dtype, shape) -> mx.array:
    """Deterministic random contents for any MLX dtype (bit patterns included)."""
    n = int(np.prod(shape)) if len(shape) else 1
    if dtype == mx.bool_:
        return mx.array(rng.integers(0, 2, size=shape).astype(np.bool_))
    if dtype in (mx.float16, mx.float32):
        return mx.array(rng.standard_normal(size=shape).astype(np.float32)).astype(dtype)
    if dtype == mx.bfloat16:
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        # Keep bf16 finite so equality is meaningful (no NaN != NaN).
        bits &= np.uint16(0xBFFF)
        return mx.array(bits).view(mx.bfloat16).reshape(shape)
    info = np.iinfo(np.dtype(str(dtype).split(".")[-1]))
    arr = rng.integers(info.min, info.max, size=shape, dtype=np.dtype(str(dtype).split(".")[-1]),
                       endpoint=True)
    return mx.array(arr)


def write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]],
                          metadata: dict[str, str] | None = None, header_pad: int = 0) -> None:
    """Writes a safetensors file by hand: tensors back to back in the given
    order, the header padded with `header_pad` trailing spaces."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode() + b" " * header_pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, (_, _, data) in tensors.items():
            f.write(data)


@contextlib.contextmanager
def pinned_in_page_cache(path: Path):
    """Every page of ``path`` in the page cache until the block ends: mapped shared and
    ``mlock``ed, so reclaim cannot take them. Reading a file once leaves its pages on
    the inactive list, the first that kswapd reclaims: under memory pressure a freshly
    warmed file can be out of the cache a moment later. Skips, with the reason, where
    mlock is refused (RLIMIT_MEMLOCK)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    for fn in (libc.munmap, libc.mlock):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap", str(path))
    try:
        if libc.mlock(addr, size) != 0:  # faults every page in, then keeps it
            err = ctypes.get_errno()
            limit = " (RLIMIT_MEMLOCK)" if err in (errno.ENOMEM, errno.EPERM) else ""
            pytest.skip(f"mlock of {path} ({size} bytes) refused: {os.strerror(err)}{limit}")
        yield
    finally:
        libc.munmap(addr, size)  # unlocks too


def tensor_bytes(a: mx.array) -> bytes:
    return bytes(memoryview(a.reshape(-1).view(mx.uint8))) if a.size else b""


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (mlx.launch uses one per rank)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    pytest.skip("no two consecutive free TCP ports on 127.0.0.1")


def mlx_launcher() -> Path:
    """``mlx.launch`` of this interpreter; skips when loopback TCP is not allowed."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
    except OSError as e:
        print(f"SKIP REASON: TCP sockets on loopback are not allowed here: {e}")
        pytest.skip(f"TCP sockets on loopback are not allowed here: {e}")
    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        pytest.fail(f"mlx.launch not found next to {sys.executable}")
    return launcher


def launch_two(launcher: Path, argv: list[str]) -> list[str]:
    """The command that runs ``argv`` as two ranks (ring backend, loopback)."""
    return [str(launcher), "--backend", "ring", "-n", "2",
            "--starting-port", str(free_port_pair()), "--", *argv]
