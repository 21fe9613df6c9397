"""Sharded checkpoints of real model shapes (:data:`SHAPES`). See docs/seed-scale.md."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import zlib
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from pyloader.compare.system import fsync_file, layer_order, remove
from pyloader.io.checkpoint import META_ALIGN
from pyloader.io.writer import NATURAL, Entry, write_tensors
from .tokenizer import write_tokenizer

_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_QWEN35_ROPE = {"rope_type": "default", "mrope_section": [11, 11, 10], "rope_theta": 10000000,
                "partial_rotary_factor": 0.25, "mrope_interleaved": True}
#: Named model configs: (published shape, changes for a tiny one of the same structure).
_NAMED: dict[str, tuple[dict, dict]] = {
    "llama3.1-8b": (
        dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
             intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0,
             rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
             tie_word_embeddings=False),
        dict(hidden_size=256, num_hidden_layers=6, intermediate_size=896,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=4096),
    ),
    "qwen3.5-9b": (
        dict(model_type="qwen3_5", tie_word_embeddings=False, text_config=dict(
            model_type="qwen3_5_text", hidden_size=4096, num_hidden_layers=32,
            intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            full_attention_interval=4, vocab_size=248320, rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_position_embeddings=262144,
            rope_parameters=_QWEN35_ROPE)),
        dict(hidden_size=256, num_hidden_layers=8, intermediate_size=768,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
             linear_value_head_dim=32, vocab_size=4096),
    ),
}


def _tiny(full: dict, changes: dict) -> dict:
    out = copy.deepcopy(full)
    (out.get("text_config") or out).update(changes)
    return out


#: Named model configs: (the published shape, a tiny one with the same structure).
SHAPES: dict[str, tuple[dict, dict]] = {
    name: (full, _tiny(full, changes)) for name, (full, changes) in _NAMED.items()}
FORMATS = ("bf16", "q4")
MARKER = "pyloader-synthetic-sharded.json"
INDEX = "model.safetensors.index.json"
#: Shard size of the hub's large models (their shards are 4-5 GB).
DEFAULT_SHARD_BYTES = 5_000_000_000
_VERSION = 1
_CHUNK = 16 << 20
# Exponent fields: weights 2^-9..2^-5 (four exponents), scales 2^-9..2^-7 (two).
_WEIGHT_EXP, _SCALE_EXP = 118, 118
_ONE = {"BF16": 0x3F80, "F32": 0x3F800000}


def shape_config(shape: str, tiny: bool = False) -> dict:
    """The config of a named shape (a fresh copy)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[shape][1 if tiny else 0])


def tensor_table(config: dict, fmt: str) -> tuple[list[Entry], dict]:
    """(name, dtype, shape, nbytes) of every tensor in ``fmt``, and the config to save."""
    from mlx_lm.utils import _get_classes, quantize_model

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if fmt == "q4":
        # quantize_model prints to stdout: keep it out of the command's output.
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size=64, bits=4)
    keep_f32 = getattr(model, "cast_predicate", None) or (lambda _: True)
    entries = []
    for name, a in tree_flatten(model.parameters()):
        if a.dtype == mx.uint32:
            dtype = "U32"
        elif fmt == "q4":
            dtype = "BF16" if name.endswith((".scales", ".biases")) else "F32"
        else:
            dtype = "BF16" if keep_f32(name) else "F32"
        itemsize = 4 if dtype in ("U32", "F32") else 2
        entries.append(Entry(name, dtype, tuple(a.shape), int(np.prod(a.shape)) * itemsize))
    return entries, config


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [seed, zlib.crc32(name.encode())])))


def _words(rng: np.random.Generator, nbytes: int, dtype: str) -> Iterator[np.ndarray]:
    uint = np.uint32 if dtype in ("U32", "F32") else np.uint16
    step = _CHUNK - _CHUNK % np.dtype(uint).itemsize
    for done in range(0, nbytes, step):
        yield np.frombuffer(rng.bytes(min(step, nbytes - done)), dtype=uint)


def _float(r: np.ndarray, dtype: str, exp: int, spread: int, signed: bool) -> np.ndarray:
    """Random sign (if ``signed``) and mantissa, exponent field ``exp + (0..spread-1)``."""
    mant = 7 if dtype == "BF16" else 23
    u = r.dtype.type
    keep = u((1 << mant) - 1) | (u(1 << (mant + 8)) if signed else u(0))
    e = u(exp) + ((r >> u(mant)) & u(spread - 1))
    return (r & keep) | (e << u(mant))


def _bf16_times(bits: np.ndarray, factor: float) -> np.ndarray:
    """bfloat16 bits of ``factor`` x the bfloat16 values ``bits`` (round to nearest even)."""
    f = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32) * np.float32(factor)
    u = f.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
            >> np.uint32(16)).astype(np.uint16)


def tensor_chunks(entry: Entry, seed: int) -> Iterator[np.ndarray]:
    """The deterministic bytes of one tensor, chunk by chunk."""
    name, dtype = entry.name, entry.dtype
    if name.endswith(".biases"):  # -7.5 x its scales, from the scales' own stream
        for r in _words(_rng(seed, name[:-len("biases")] + "scales"), entry.nbytes, dtype):
            yield _bf16_times(_float(r, dtype, _SCALE_EXP, 2, signed=False), -7.5)
        return
    if len(entry.shape) == 1 and "norm" in name.rsplit(".", 2)[-2]:
        uint = np.uint32 if dtype == "F32" else np.uint16
        yield np.full(entry.nbytes // np.dtype(uint).itemsize, _ONE[dtype], uint)
        return
    for r in _words(_rng(seed, name), entry.nbytes, dtype):
        if dtype == "U32":
            yield r
        elif name.endswith(".scales"):
            yield _float(r, dtype, _SCALE_EXP, 2, signed=False)
        else:
            yield _float(r, dtype, _WEIGHT_EXP, 4, signed=True)


def _shards(entries: list[Entry], shard_bytes: int) -> list[list[Entry]]:
    """Tensors in layer order, cut into shards of at most ``shard_bytes`` each."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in sorted(entries, key=lambda e: layer_order(e.name)):
        if shards[-1] and size + e.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def make_sharded_model(path: str | os.PathLike[str], shape: str, fmt: str = "bf16", *,
                       seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES,
                       tiny: bool = False) -> Path:
    """Writes (once) ``shape`` in ``fmt`` as a sharded mlx-lm directory; returns it."""
    path = Path(path)
    config = shape_config(shape, tiny)
    spec = {"shape": shape, "format": fmt, "seed": seed, "shard_bytes": int(shard_bytes),
            "tiny": tiny, "version": _VERSION}
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        # already written; only its tokenizer may be missing
        return write_tokenizer(path, (config.get("text_config") or config)["vocab_size"])
    entries, config = tensor_table(config, fmt)
    path.mkdir(parents=True, exist_ok=True)
    remove(marker)
    for old in path.glob("model*.safetensors"):
        remove(old)
    shards = _shards(entries, shard_bytes)
    weight_map = {}
    meta = {"format": "mlx", META_ALIGN: NATURAL,
            "pyloader.synthetic": json.dumps(spec, sort_keys=True)}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_tensors(path / fname, shard, lambda n, by={e.name: e for e in shard}:
                      tensor_chunks(by[n], seed), meta)
        weight_map.update({e.name: fname for e in shard})
    total = sum(e.nbytes for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX).write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, (config.get("text_config") or config)["vocab_size"])
    for f in (INDEX, "config.json"):
        fsync_file(path / f)
    marker.write_text(json.dumps(spec))
    return path
