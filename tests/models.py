"""Tiny real mlx-lm checkpoints with fixed seeds, for bit-exactness tests."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

ARCHS = {
    "llama": {"model_type": "llama"},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    # Sliding-window attention on 3 of every 4 layers.
    "gemma3_text": {"model_type": "gemma3_text", "num_hidden_layers": 4, "head_dim": 16,
                    "query_pre_attn_scalar": 16, "sliding_window": 4,
                    "sliding_window_pattern": 4},
}

# Hybrid: gated-delta linear attention with full attention every 2nd layer.
QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 1e-6,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
    "tie_word_embeddings": True, "max_position_embeddings": 512,
}
ARCHS["qwen3_5"] = {"model_type": "qwen3_5", "text_config": QWEN3_5_TEXT}


def config_of(arch: str, **over) -> dict:
    """The config.json of a tiny `arch` model, with `over` applied to the
    text model's settings."""
    spec = ARCHS[arch]
    if "text_config" in spec:
        return {**spec, "text_config": {**spec["text_config"], **over}}
    return {**BASE, **spec, **over}


def build_model(arch: str, *, dtype=mx.bfloat16, bits: int | None = None, seed: int = 0,
                fill_zeros: bool = False, mode: str = "affine",
                **over) -> tuple[nn.Module, dict]:
    """A random model of `arch` (seeded), cast to `dtype`, optionally
    quantized (group size 32, MLX's quantization `mode`), evaluated; returns it
    with its config.

    `fill_zeros`: parameters mlx-lm initializes to all zeros (biases, attention
    sinks, a router's weight or correction bias) get small random values, so
    they matter to the output."""
    config = config_of(arch, **over)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if fill_zeros:
        model.update(tree_map(
            lambda p: 0.1 * mx.random.normal(p.shape).astype(p.dtype)
            if mx.issubdtype(p.dtype, mx.floating) and not mx.any(p).item() else p,
            model.parameters()))
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=bits, mode=mode)
    mx.eval(model.parameters())
    return model, config


def make_model_dir(path: Path, arch: str, *, dtype=mx.bfloat16, bits: int | None = None,
                   seed: int = 0, fill_zeros: bool = False, mode: str = "affine",
                   **over) -> Path:
    """Builds a random model of `arch` (see build_model; `over` changes its
    config) and saves it the way mlx-lm does (mx.save_safetensors, so tensor
    offsets are often misaligned)."""
    model, config = build_model(arch, dtype=dtype, bits=bits, seed=seed,
                                fill_zeros=fill_zeros, mode=mode, **over)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


def model_with_weights(path: Path, weights: dict[str, mx.array]) -> nn.Module:
    """The checkpoint's mlx-lm model (structure from config.json, lazily
    loaded so mx.load reads nothing) with `weights` put in place."""
    model, _ = load_model(path, lazy=True)
    model.load_weights(list(weights.items()), strict=True)
    return model


def logits(model: nn.Module, tokens: list[int]) -> mx.array:
    out = model(mx.array([tokens]))
    mx.eval(out)
    return out


def repad_header(file: Path, residue: int, modulus: int = 8) -> None:
    """Rewrites a safetensors file with trailing spaces in its header so the
    data section starts at `residue` mod `modulus` (same tensors, new offsets)."""
    import struct

    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = raw[8:8 + n].rstrip(b" "), raw[8 + n:]
    pad = (residue - (8 + len(header))) % modulus
    file.write_bytes(struct.pack("<Q", len(header) + pad) + header + b" " * pad + data)
