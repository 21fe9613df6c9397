"""Deterministic synthetic checkpoints and models for tests and benchmarks.

Two writers give the two layouts a loader meets in practice:

* ``"safetensors"``: the reference writer (``safetensors.numpy.save_file``):
  the header is padded to a multiple of 8 bytes, so every tensor is aligned to
  its dtype.
* ``"mlx"``: ``mx.save_safetensors``: the header is not padded, so tensors
  are usually misaligned. The marker in ``__metadata__`` is sized so that the
  data section starts at an odd offset: every multi-byte tensor is misaligned,
  the worst case for zero-copy loading, on purpose.

Tensor contents depend only on ``(seed, tensor name)``, so both layouts of one
spec hold identical tensors, generated and written chunk by chunk so memory
stays small:

* the reference writer lays the file out from zero-filled buffers that are
  never touched (so never resident), then the bytes are written in place;
* ``mx.save_safetensors`` first makes every array contiguous and evaluates them
  all, so it holds the whole checkpoint in memory (and it copies even
  zero-copy ``mmap`` arrays: MLX's ``contiguous`` trusts the allocator's size
  header, which a view into a file does not have). So the file is written the
  way MLX writes it (compact JSON with sorted keys, no padding, tensors in the
  order of MLX's hash map), after checking on a tiny model with the same tensor
  names that this replica is byte-identical to ``mx.save_safetensors``; if it
  ever is not, the real ``mx.save_safetensors`` is used (whole model in memory).

Models (:func:`make_model`, :func:`make_variant`): random-weight mlx-lm models of a chosen
size, real mlx-lm model classes with fixed seeds, saved the way mlx-lm saves models
(``mlx_lm.utils.save_model``: ``mx.save_safetensors``, so tensors are packed in hash order
and mostly misaligned, as in real MLX checkpoints).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import warnings
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .._util.fs import cache_dir, fsync_file
from .._util.names import count_layers
from .._util.sizes import format_size
from ..heads import is_head_tensor
from ..io.checkpoint import Checkpoint
from .tokenizer import write_tokenizer

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
    """The llama-like shape whose weights take about ``size_bytes``.

    Picks the widest model that still has at least 8 layers (1 GiB of bf16 gives
    hidden 2048, intermediate 5632, 9 layers, vocab 32000), with embedding and
    head at most ~30% of the total like real small models.
    """
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
    """The deterministic bytes of one tensor, as uint8 arrays of at most ``chunk``
    bytes (floats kept finite by clearing the exponent's top bit)."""
    _, itemsize, mask = DTYPES[dtype]
    uint = {2: np.uint16, 4: np.uint32}[itemsize]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))
    chunk -= chunk % itemsize
    done = 0
    while done < nbytes:
        n = min(chunk, nbytes - done)
        words = np.frombuffer(rng.bytes(n), dtype=uint) & uint(mask)
        yield words.view(np.uint8)
        done += n


def existing_spec(path: str | os.PathLike[str]) -> dict | None:
    """The synthetic spec recorded in a checkpoint file, or None (missing, not
    synthetic, or not a valid safetensors file)."""
    try:
        meta = Checkpoint(path).metadata()
    except (OSError, ValueError):
        return None
    try:
        return json.loads(meta[MARKER_KEY])
    except (KeyError, ValueError):
        return None


def make_checkpoint(
    path: str | os.PathLike[str],
    size_bytes: int = 1 << 30,
    dtype: str = "bf16",
    writer: str = "safetensors",
    seed: int = 0,
) -> str:
    """Write a llama-shaped synthetic checkpoint (a single ``.safetensors`` file).

    Args:
        path: Output file. Written to a temporary name and renamed when
            complete, so an interrupted run never leaves a valid-looking file.
        size_bytes: Approximate total tensor bytes.
        dtype: ``"bf16"``, ``"f16"`` or ``"f32"``.
        writer: ``"safetensors"`` (padded header, aligned tensors) or ``"mlx"``
            (``mx.save_safetensors``: unpadded header, misaligned tensors).
        seed: Seed of the tensor contents.

    Returns:
        ``path`` as a string. Nothing is written when ``path`` already holds a
        checkpoint with the same spec (the spec is kept in ``__metadata__``).
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
        # np.zeros is calloc: untouched pages are never resident, so this lays
        # out the file (header, order, padding) with the reference writer at
        # almost no memory cost. The data is written below.
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
    """What ``safetensors.serialize_file`` writes for tensors of one dtype, for
    machines without safetensors (or bf16 without ml_dtypes): ``__metadata__``
    first, tensors sorted by name, compact JSON padded with spaces to a multiple
    of 8. Data bytes are left as zeros (a sparse file) for :func:`_fill`."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shp in sorted(tensors):
        n = int(np.prod(shp)) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shp), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)


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
        _write_mlx_real(path, shape, spec)
        return
    st_dtype, itemsize, _ = DTYPES[spec["dtype"]]
    shapes = dict(shape.tensors())
    header = None
    for pad in ("", "-"):  # one of two lengths is odd
        text = _mlx_header(order, shapes, st_dtype, itemsize,
                           {MARKER_KEY: _marker(spec), PAD_KEY: pad})
        if (8 + len(text)) % 2 == 1:
            header = text
            break
    assert header is not None
    _write_ordered(path, header, order, shapes, itemsize, spec)


def _mlx_header(order, shapes, st_dtype, itemsize, metadata) -> bytes:
    """The header ``mx.save_safetensors`` writes: nlohmann's compact dump of
    objects with sorted keys, no padding."""
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
    """The order ``mx.save_safetensors`` writes ``shape``'s tensors in, checked
    by writing a tiny model with the same names both with MLX and with
    :func:`_write_ordered`; None when the two files differ."""
    tiny = LlamaShape(vocab=3, hidden=2, intermediate=5, kv_dim=1, layers=shape.layers)
    spec = {"dtype": dtype, "seed": 1}
    st_dtype, itemsize, _ = DTYPES[dtype]
    shapes = dict(tiny.tensors())
    arrays = {}
    for name, shp in tiny.tensors():  # same names, same insertion order
        data = b"".join(bytes(c) for c in tensor_chunks(
            name, int(np.prod(shp)) * itemsize, dtype, spec["seed"]))
        arrays[name] = mx.array(np.frombuffer(data, np.uint8)).view(
            getattr(mx, _MX_DTYPES[st_dtype])).reshape(shp)
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
            "mx.save_safetensors no longer writes the layout pyloader.synthetic "
            "reproduces; writing with MLX itself (holds the whole model in memory)",
            RuntimeWarning, stacklevel=3)
        return None
    return order


def _write_mlx_real(path: str, shape: LlamaShape, spec: dict) -> None:
    st_dtype, itemsize, _ = DTYPES[spec["dtype"]]
    arrays = {}
    for name, shp in shape.tensors():
        buf = bytearray()
        for chunk in tensor_chunks(name, int(np.prod(shp)) * itemsize, spec["dtype"], spec["seed"]):
            buf += chunk
        arrays[name] = mx.array(np.frombuffer(buf, np.uint8)).view(
            getattr(mx, _MX_DTYPES[st_dtype])).reshape(shp)
    mx.save_safetensors(path, arrays, metadata={MARKER_KEY: _marker(spec), PAD_KEY: ""})


def synthetic_pair(
    size_bytes: int = 1 << 30, dtype: str = "bf16", seed: int = 0, directory: str | None = None
) -> dict[str, str]:
    """The same synthetic model written by both writers, generated once and
    cached. Returns ``{"safetensors": path, "mlx": path}``."""
    directory = directory or str(cache_dir("synthetic"))
    stem = os.path.join(directory, f"llama-{format_size(size_bytes)}-{dtype}-seed{seed}")
    ref = make_checkpoint(f"{stem}-safetensors.safetensors", size_bytes, dtype, "safetensors", seed)
    mlx = make_checkpoint(f"{stem}-mlx.safetensors", size_bytes, dtype, "mlx", seed)
    return {"safetensors": ref, "mlx": mlx}


# ----------------------------------------------------------------------------
# Models

MARKER = "pyloader-synthetic-model.json"


def llama_config(size_bytes: int, itemsize: int = 2) -> dict:
    """A llama config (hidden 2048, MHA, SwiGLU 5632, vocab 8192, untied) with
    as many layers as fit in ``size_bytes``."""
    hidden, inter, vocab = 2048, 5632, 8192
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * itemsize
    fixed = (2 * vocab * hidden + hidden) * itemsize
    layers = max(2, (size_bytes - fixed) // per_layer)
    return dict(model_type="llama", hidden_size=hidden, num_hidden_layers=int(layers),
                intermediate_size=inter, num_attention_heads=16, num_key_value_heads=16,
                rms_norm_eps=1e-5, vocab_size=vocab, max_position_embeddings=4096,
                tie_word_embeddings=False)


def qwen3_config(size_bytes: int, itemsize: int = 2) -> dict:
    """A qwen3 config (hidden 2048, 16 query / 8 KV heads of 128, q/k norms, SwiGLU 5632,
    vocab 8192, untied) with as many layers as fit in ``size_bytes``."""
    hidden, inter, vocab, heads, kv, hd = 2048, 5632, 8192, 16, 8, 128
    per_layer = (2 * hidden * heads * hd + 2 * hidden * kv * hd + 3 * hidden * inter
                 + 2 * hidden + 2 * hd) * itemsize
    fixed = (2 * vocab * hidden + hidden) * itemsize
    layers = max(2, (size_bytes - fixed) // per_layer)
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=int(layers),
                intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=hd, rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=1000000.0,
                max_position_embeddings=4096, tie_word_embeddings=False)


#: Architectures :func:`make_model` writes: (config for a size, mlx-lm module).
MODEL_ARCHS = {"llama": llama_config, "qwen3": qwen3_config}


def make_model(path: str | os.PathLike[str], size_bytes: int, *, dtype: str = "bf16",
               seed: int = 0, arch: str = "llama") -> Path:
    """Writes (once; reused when the marker matches) a ``arch`` model (llama or qwen3)
    of about ``size_bytes`` with random weights scaled to keep activations finite."""
    import importlib

    from mlx_lm.utils import save_config, save_model

    if arch not in MODEL_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(MODEL_ARCHS)}, not {arch!r}")
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    path = Path(path)
    spec = {"size_bytes": size_bytes, "dtype": dtype, "seed": seed, "version": 1}
    if arch != "llama":  # (llama models were written before the field existed)
        spec["arch"] = arch
    marker = path / MARKER
    dt = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}[dtype]
    config = MODEL_ARCHS[arch](size_bytes, dt.size)
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return write_tokenizer(path, config["vocab_size"])  # (older ones had none)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: (p * 0.5).astype(dt), model.parameters()))
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path, config["vocab_size"])
    marker.write_text(json.dumps(spec))
    return path


def make_variant(src: str | os.PathLike[str], dst: str | os.PathLike[str], tail: int, *,
                 seed: int, scale: float = 0.05) -> Path:
    """A "fine-tuned" variant of the model at ``src``: seeded noise on the
    floating-point tensors of its head (the last ``tail`` layers, the final
    norm, lm_head; quantized layers through their scales and biases), every
    other tensor byte-identical. Saved like mlx-lm saves models
    (``mx.save_safetensors``, one file); other files are copied."""
    src, dst = Path(src), Path(dst)
    ckpt = Checkpoint(src)
    layers = count_layers(ckpt.keys())
    weights: dict = {}
    for f in ckpt.files:
        weights.update(mx.load(f))
    key = mx.random.key(seed)
    for name in sorted(weights):
        w = weights[name]
        if not is_head_tensor(name, layers, tail) or not mx.issubdtype(w.dtype, mx.floating):
            continue
        key, sub = mx.random.split(key)
        noise = mx.random.normal(w.shape, key=sub) * scale
        weights[name] = (w.astype(mx.float32) * (1 + noise)).astype(w.dtype)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    for entry in src.iterdir():
        if entry.is_file() and entry.suffix != ".safetensors" and \
                entry.name != "model.safetensors.index.json":
            shutil.copy2(entry, dst / entry.name)
    return dst


# ----------------------------------------------------------------------------
# Mixture-of-experts models with routing locality

MOE_MARKER = "pyloader-synthetic-moe.json"


def moe_config(size_bytes: int, *, bits: Optional[int] = 4, num_experts: int = 64,
               top_k: int = 4, hidden: int = 1024, moe_intermediate: int = 512) -> dict:
    """A qwen3_moe config (GQA attention, ``num_experts`` experts of ``moe_intermediate``
    per layer, top-``top_k`` routing, vocab 8192) with as many layers as fit in
    ``size_bytes`` (4-bit: 0.5 bytes per weight plus float32 scales and biases per group
    of 64; ``bits=None``: float32, the only dtype MLX's CPU ``gather_mm`` computes in)."""
    per_weight = 0.5 + 8 / 64 if bits == 4 else 4.0
    vocab, heads, kv_heads, head_dim = 8192, 8, 4, hidden // 8
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    per_layer = (attention + 3 * hidden * moe_intermediate * num_experts) * per_weight
    per_layer += hidden * num_experts * (1 + 8 / 64 if bits == 4 else 4)  # router (8-bit)
    fixed = 2 * vocab * hidden * per_weight
    layers = max(2, int((size_bytes - fixed) // per_layer))
    return dict(model_type="qwen3_moe", hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=4 * hidden, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=num_experts,
                num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
                moe_intermediate_size=moe_intermediate, rms_norm_eps=1e-6, vocab_size=vocab,
                rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096,
                norm_topk_prob=True)


def make_moe_model(path: str | os.PathLike[str], size_bytes: int, *, bits: Optional[int] = 4,
                   num_experts: int = 64, top_k: int = 4, skew: float = 0.2,
                   token_scale: float = 16.0, seed: int = 0) -> Path:
    """Writes (once; reused when the marker matches) a random-weight qwen3_moe of about
    ``size_bytes`` whose routing has the locality of a real MoE model.

    Plain random weights route almost the same experts for every token (the normalized
    hidden state hardly depends on the token: a 25% LRU cache hits > 0.9), unlike a real
    model. Two changes give realistic routing:

    * the token decides: every embedding row is scaled by ``token_scale``, so the hidden
      state entering each router is dominated by the current token's embedding and the
      router's random rows pick different experts for different tokens;
    * some experts are popular: each embedding row also gets a shared component along a
      fixed unit vector u, and each router row a component along u sized (from a
      calibration pass over random tokens, layer by layer) so that it adds
      ``skew × log p_e`` to expert e's logit, with p_e Zipf-distributed over a seeded
      permutation of the layer's experts.

    The hit rates this gives are measured in docs/expert-streaming.md."""
    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import quantize_model, save_config, save_model

    path = Path(path)
    spec = {"size_bytes": size_bytes, "bits": bits, "num_experts": num_experts,
            "top_k": top_k, "skew": skew, "token_scale": token_scale, "seed": seed,
            "version": 3}
    marker = path / MOE_MARKER
    config = moe_config(size_bytes, bits=bits, num_experts=num_experts, top_k=top_k)
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return write_tokenizer(path, config["vocab_size"])  # (older ones had none)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    # float32 throughout (quantized: float32 scales and biases): MLX's CPU kernels are
    # several times faster with float32 activations than with bfloat16 ones.
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    u = rng.standard_normal(hidden).astype(np.float32)
    u /= np.linalg.norm(u)
    emb = model.model.embed_tokens.weight
    row = float(mx.sqrt(mx.mean(mx.sum(emb * emb, axis=1))))
    model.model.embed_tokens.weight = token_scale * emb + token_scale * 0.5 * row * mx.array(u)
    zipf = 1.0 / np.arange(1, num_experts + 1)
    logp = np.log(zipf / zipf.sum())
    probe = mx.array(rng.integers(0, vocab, size=(1, 64)))
    gates = [layer.mlp.gate for layer in model.model.layers]

    def calibrate(i, x):
        # Layer i's router input depends only on layers < i, already calibrated
        # earlier in this pass: one forward pass sets every layer's bias.
        gate = gates[i]
        along = float(mx.mean(x.astype(mx.float32) @ mx.array(u)))
        order = rng.permutation(num_experts)
        bias = (skew * logp[order] / along).astype(np.float32)
        gate.weight = gate.weight + mx.array(bias[:, None] * u[None, :])
        mx.eval(gate.weight)
        return x @ gate.weight.T

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate = lambda x, i=i: calibrate(i, x)  # for the calibration pass only
    try:
        model(probe)
    finally:
        for layer, gate in zip(model.model.layers, gates):
            layer.mlp.gate = gate
    mx.eval(model.parameters())
    if bits is not None:
        # (quantize_model prints "[INFO] Quantized model with ..." to stdout, into the
        # output of whatever command built this model: kept out.)
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size=64, bits=bits,
                                           quant_predicate=model.quant_predicate)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path, config["vocab_size"])
    marker.write_text(json.dumps(spec))
    return path
