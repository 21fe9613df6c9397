"""Deterministic synthetic checkpoints in an aligned or misaligned layout."""

from __future__ import annotations

import json
import os
import struct
import warnings
import zlib
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from pyloader.compare.system import cache_dir, format_size, fsync_file
from pyloader.io.checkpoint import Checkpoint
from pyloader.io.writer import header_bytes

MARKER_KEY = "pyloader.synthetic"
PAD_KEY = "pyloader.pad"
FORMAT_VERSION = 1
WRITERS = ("safetensors", "mlx")
DTYPES = {
    # name: (safetensors dtype, itemsize, mask that keeps floats finite)
    "bf16": ("BF16", 2, 0xBFFF),
    "f16": ("F16", 2, 0xBFFF),
    "f32": ("F32", 4, 0xBFFFFFFF),
}
_CHUNK = 16 << 20
_HIDDEN_SIZES = (64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 8192)
_MIN_LAYERS = 8


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a llama-style decoder (GQA, SwiGLU MLP, untied head)."""

    vocab: int
    hidden: int
    intermediate: int
    kv_dim: int
    layers: int

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in model order."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    @property
    def params(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def llama_shape(size_bytes: int, itemsize: int = 2) -> LlamaShape:
    """The llama-like shape (at least 8 layers) whose weights take about ``size_bytes``."""
    params = max(size_bytes // itemsize, 1)

    def shape_for(h: int) -> LlamaShape:
        inter = _round_up(h * 8 // 3, 256 if h >= 1024 else 64)
        kv = max(64 if h <= 1024 else 128, h // 4)
        vocab = min(32000, max(64, int(0.15 * params / h) // 64 * 64))
        per_layer = 2 * h * h + 2 * kv * h + 3 * h * inter + 2 * h
        layers = max(1, round((params - 2 * vocab * h - h) / per_layer))
        return LlamaShape(vocab, h, inter, kv, layers)

    shapes = [shape_for(h) for h in _HIDDEN_SIZES]
    deep = [s for s in shapes if s.layers >= _MIN_LAYERS]
    return deep[-1] if deep else shapes[0]


def _spec(size_bytes: int, dtype: str, writer: str, seed: int) -> dict:
    shape = llama_shape(size_bytes, DTYPES[dtype][1])
    return {
        "format": FORMAT_VERSION,
        "size_bytes": int(size_bytes),
        "dtype": dtype,
        "writer": writer,
        "seed": int(seed),
        "shape": asdict(shape),
    }


def _marker(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def tensor_chunks(name: str, nbytes: int, dtype: str, seed: int, chunk: int = _CHUNK):
    """The deterministic bytes of one tensor, as uint8 chunks (floats kept finite)."""
    _, itemsize, mask = DTYPES[dtype]
    uint = {2: np.uint16, 4: np.uint32}[itemsize]
    seq = np.random.SeedSequence([seed, zlib.crc32(name.encode())])
    rng = np.random.Generator(np.random.PCG64(seq))
    chunk -= chunk % itemsize
    done = 0
    while done < nbytes:
        n = min(chunk, nbytes - done)
        words = np.frombuffer(rng.bytes(n), dtype=uint) & uint(mask)
        yield words.view(np.uint8)
        done += n


def existing_spec(path: str | os.PathLike[str]) -> dict | None:
    """The synthetic spec recorded in a checkpoint file, or None."""
    try:
        return json.loads(Checkpoint(path).metadata()[MARKER_KEY])
    except (OSError, KeyError, ValueError):  # FormatError and bad JSON are ValueErrors
        return None


def make_checkpoint(
    path: str | os.PathLike[str],
    size_bytes: int = 1 << 30,
    dtype: str = "bf16",
    writer: str = "safetensors",
    seed: int = 0,
) -> str:
    """Write a llama-shaped synthetic checkpoint (one ``.safetensors`` file, atomically).

    Args:
        size_bytes: Approximate total tensor bytes.
        dtype: ``"bf16"``, ``"f16"`` or ``"f32"``.
        writer: ``"safetensors"`` (aligned) or ``"mlx"`` (misaligned).
        seed: Seed of the tensor contents.

    Returns ``path``; nothing is written if it already holds the same spec.
    """
    path = os.fspath(path)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(DTYPES)}")
    if writer not in WRITERS:
        raise ValueError(f"unknown writer {writer!r}; expected one of {WRITERS}")
    if size_bytes <= 0:
        raise ValueError(f"size_bytes must be positive, got {size_bytes}")
    spec = _spec(size_bytes, dtype, writer, seed)
    if existing_spec(path) == spec:
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # mx.save_safetensors appends ".safetensors" to names without it.
    tmp = f"{path}.tmp{os.getpid()}.safetensors"
    try:
        if writer == "safetensors":
            _write_reference(tmp, spec)
        else:
            _write_mlx(tmp, spec)
        fsync_file(tmp)  # clean pages: a cold-start eviction can really drop them
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # the Rust writer creates files 0600
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _write_reference(path: str, spec: dict) -> None:
    shape = LlamaShape(**spec["shape"])
    st_dtype, itemsize, _ = DTYPES[spec["dtype"]]
    metadata = {MARKER_KEY: _marker(spec)}
    tensors = shape.tensors()
    np_dtype = _numpy_dtype(spec["dtype"])
    try:
        from safetensors.numpy import save_file
    except ImportError:
        save_file = None
    if save_file is not None and np_dtype is not None:
        # np.zeros is calloc: lay out the file without touching pages; data written below.
        save_file({n: np.zeros(s, np_dtype) for n, s in tensors}, path, metadata=metadata)
    else:
        _write_reference_layout(path, tensors, st_dtype, itemsize, metadata)
    _fill(path, spec)


def _numpy_dtype(dtype: str):
    if dtype == "f16":
        return np.float16
    if dtype == "f32":
        return np.float32
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


def _write_reference_layout(path, tensors, st_dtype, itemsize, metadata) -> None:
    """The reference writer's layout with zero data (a sparse file) for :func:`_fill`."""
    entries, offset = [], 0
    for name, shp in sorted(tensors):
        n = int(np.prod(shp)) * itemsize
        entries.append((name, st_dtype, list(shp), offset, offset + n, None))
        offset += n
    head = header_bytes(entries, metadata, align=8)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + offset)


def _fill(path: str, spec: dict) -> None:
    """Write every tensor's deterministic bytes in place, chunk by chunk."""
    ckpt = Checkpoint(path)
    fd = os.open(path, os.O_WRONLY)
    try:
        for t in ckpt.tensors():
            pos = t.offset
            for chunk in tensor_chunks(t.name, t.nbytes, spec["dtype"], spec["seed"]):
                mv = memoryview(chunk)
                while mv:
                    n = os.pwrite(fd, mv, pos)
                    mv, pos = mv[n:], pos + n
    finally:
        os.close(fd)


_MX_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _write_mlx(path: str, spec: dict) -> None:
    shape = LlamaShape(**spec["shape"])
    order = _mlx_order(path, shape, spec["dtype"])
    if order is None:
        mx.save_safetensors(path, _mx_arrays(shape, spec),
                            metadata={MARKER_KEY: _marker(spec), PAD_KEY: ""})
        return
    st_dtype, itemsize, _ = DTYPES[spec["dtype"]]
    shapes = dict(shape.tensors())
    headers = (_mlx_header(order, shapes, st_dtype, itemsize,
                           {MARKER_KEY: _marker(spec), PAD_KEY: pad}) for pad in ("", "-"))
    header = next(h for h in headers if (8 + len(h)) % 2)  # one of the two lengths is odd
    _write_ordered(path, header, order, shapes, itemsize, spec)


def _mlx_header(order, shapes, st_dtype, itemsize, metadata) -> bytes:
    """The header ``mx.save_safetensors`` writes: compact, sorted keys, no padding."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        nb = int(np.prod(shapes[name])) * itemsize
        header[name] = {"data_offsets": [offset, offset + nb], "dtype": st_dtype,
                        "shape": list(shapes[name])}
        offset += nb
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _write_ordered(path, header: bytes, order, shapes, itemsize, spec) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name in order:
            nb = int(np.prod(shapes[name])) * itemsize
            f.writelines(tensor_chunks(name, nb, spec["dtype"], spec["seed"]))


def _mlx_order(path: str, shape: LlamaShape, dtype: str) -> list[str] | None:
    """The order ``mx.save_safetensors`` writes ``shape`` in, or None if unverified."""
    tiny = LlamaShape(vocab=3, hidden=2, intermediate=5, kv_dim=1, layers=shape.layers)
    spec = {"dtype": dtype, "seed": 1}
    st_dtype, itemsize, _ = DTYPES[dtype]
    shapes = dict(tiny.tensors())
    arrays = _mx_arrays(tiny, spec)  # same names, same insertion order
    metadata = {MARKER_KEY: "probe", PAD_KEY: ""}
    real, replica = f"{path}.probe-mlx.safetensors", f"{path}.probe-replica.safetensors"
    try:
        mx.save_safetensors(real, arrays, metadata=metadata)
        with open(real, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        _write_ordered(replica, _mlx_header(order, shapes, st_dtype, itemsize, metadata),
                       order, shapes, itemsize, spec)
        with open(real, "rb") as a, open(replica, "rb") as b:
            same = a.read() == b.read()
    finally:
        for p in (real, replica):
            if os.path.exists(p):
                os.remove(p)
    if not same:
        warnings.warn(
            "mx.save_safetensors no longer writes the layout benchlib.synthetic "
            "reproduces; writing with MLX itself (holds the whole model in memory)",
            RuntimeWarning, stacklevel=3)
        return None
    return order


def _mx_arrays(shape: LlamaShape, spec: dict) -> dict[str, mx.array]:
    st_dtype, itemsize, _ = DTYPES[spec["dtype"]]
    arrays = {}
    for name, shp in shape.tensors():
        data = b"".join(bytes(c) for c in tensor_chunks(
            name, int(np.prod(shp)) * itemsize, spec["dtype"], spec["seed"]))
        arrays[name] = mx.array(np.frombuffer(data, np.uint8)).view(
            getattr(mx, _MX_DTYPES[st_dtype])).reshape(shp)
    return arrays


def synthetic_pair(
    size_bytes: int = 1 << 30, dtype: str = "bf16", seed: int = 0, directory: str | None = None
) -> dict[str, str]:
    """The same synthetic model from both writers, cached: ``{"safetensors": p, "mlx": p}``."""
    directory = directory or str(cache_dir("synthetic"))
    stem = os.path.join(directory, f"llama-{format_size(size_bytes)}-{dtype}-seed{seed}")
    ref = make_checkpoint(f"{stem}-safetensors.safetensors", size_bytes, dtype, "safetensors", seed)
    mlx = make_checkpoint(f"{stem}-mlx.safetensors", size_bytes, dtype, "mlx", seed)
    return {"safetensors": ref, "mlx": mlx}
