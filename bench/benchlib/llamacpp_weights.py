"""The llama.cpp suite's weights (bench/llama_cpp.py): the named shapes, one llama of a
shape with fixed random weights that float16 and bfloat16 both hold exactly, written once
as mlx-lm directories (float16, bfloat16, 4- and 8-bit affine) and as GGUF files by the
llama.cpp Python (:mod:`benchlib.llamacpp_engine`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np

from benchlib.llamacpp_levels import run_engine

#: Named shapes: untied llamas without RoPE scaling (llama3.1-8b's "llama3" scaling
#: changes no cost at these lengths and would need llama.cpp's rope_freqs tensor).
SHAPES: dict[str, dict] = {
    "tinyllama-1.1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=22, intermediate_size=5632,
        num_attention_heads=32, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=32000, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=False),
    # For tests: every dimension a multiple of 256 (llama.cpp's AMX kernels need it).
    "tiny": dict(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=768,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=4096, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=False),
}
#: Formats: (llama.cpp's label, GGUF file stem, mlx-lm directory, mlx-lm's label).
FORMATS = {
    "q4": ("Q4_0", "q4_0", "mlx-q4", "4-bit g64, float16 scales"),
    "q8": ("Q8_0", "q8_0", "mlx-q8", "8-bit g64, float16 scales"),
    "f16": ("F16", "f16", "mlx-f16", "float16"),
    "bf16": ("BF16", "bf16", "mlx-bf16", "bfloat16"),
    # GGUF only (no mlx-lm directory): llama.cpp's K-quant mixes, measured in place.
    "q4_k_m": ("Q4_K_M", "q4_k_m", None, "the GGUF file, in place"),
    "q5_k_m": ("Q5_K_M", "q5_k_m", None, "the GGUF file, in place"),
    "q6_k": ("Q6_K", "q6_k", None, "the GGUF file, in place"),
}
#: Formats ``llama_model_quantize`` makes from the F16 GGUF.
QUANTIZED = ("q4", "q8", "q4_k_m", "q5_k_m", "q6_k")

#: Bumped when the written weights change (a cached root of another version is rewritten).
VERSION = 2
_STD = 0.02
_CHUNK = 1 << 22


def shape_config(shape: str) -> dict:
    if shape in SHAPES:
        return dict(SHAPES[shape])
    from benchlib.synthetic.shapes import shape_config

    base, tiny = (shape[:-len("-tiny")], True) if shape.endswith("-tiny") else (shape, False)
    try:
        config = shape_config(base, tiny)
    except ValueError:
        raise ValueError(f"unknown shape {shape!r}; expected one of "
                         f"{', '.join(shape_names())}") from None
    if config.get("model_type") != "llama":
        raise ValueError(f"shape {shape!r} is not a llama")
    config.pop("rope_scaling", None)
    return config


def shape_names() -> list[str]:
    from benchlib.synthetic.shapes import SHAPES as SCALE_SHAPES

    llamas = [s for s, (full, _) in SCALE_SHAPES.items() if full.get("model_type") == "llama"]
    return list(SHAPES) + llamas + [f"{s}-tiny" for s in llamas]


def n_params(config: dict) -> int:
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = h * q * 2 + h * kv * 2 + 3 * h * f + 2 * h
    return config["num_hidden_layers"] * layer + 2 * v * h + h


# --- the weights ---------------------------------------------------------------------

def _tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of mlx-lm's llama parameters for ``config``."""
    from benchlib.synthetic.shapes import tensor_table

    return [(e.name, e.shape) for e in tensor_table(config, "bf16")[0]]


def tensor_values(name: str, shape: tuple[int, ...], seed: int):
    """Chunks (float16 arrays) of one tensor: norms 1, Q and K projections
    normal(0, 2/sqrt(columns)), the others normal(0, 0.02), rounded to bfloat16 and
    flushed to 0 below float16's normal range, so float16 and bfloat16 hold them
    exactly. Depends only on (seed, name).

    The large Q and K make attention scores of order 4: attention is peaked and depends
    on the positions, so a Q/K layout that RoPE does not expect changes the logits (with
    0.02 at hidden 256, attention is nearly uniform and hides it)."""
    n = int(np.prod(shape))
    if len(shape) == 1 and "norm" in name:
        yield np.ones(n, np.float16)
        return
    std = 2 / np.sqrt(shape[-1]) if name.endswith(("q_proj.weight", "k_proj.weight")) \
        else _STD
    rng = np.random.Generator(np.random.PCG64(
        np.random.SeedSequence([seed, zlib.crc32(name.encode())])))
    for done in range(0, n, _CHUNK):
        x = rng.standard_normal(min(_CHUNK, n - done), dtype=np.float32) * np.float32(std)
        u = x.view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & \
            np.uint32(0xFFFF0000)
        x = u.view(np.float32)
        x[np.abs(x) < np.float32(2.0**-14)] = 0
        yield x.astype(np.float16)


def write_float16_model(path: Path, config: dict, seed: int) -> Path:
    """The float16 mlx-lm directory (one ``model.safetensors``, config, tokenizer)."""
    from benchlib.synthetic.tokenizer import write_tokenizer
    from pyloader.io.writer import Entry, write_tensors

    tensors = _tensors(config)
    entries = [Entry(n, "F16", s, int(np.prod(s)) * 2) for n, s in tensors]
    shapes = dict(tensors)
    path.mkdir(parents=True, exist_ok=True)
    write_tensors(path / "model.safetensors", entries,
                  lambda n: (c.tobytes() for c in tensor_values(n, shapes[n], seed)),
                  {"format": "pt"})
    (path / "config.json").write_text(json.dumps(dict(config, torch_dtype="float16"),
                                                 indent=2))
    write_tokenizer(path, config["vocab_size"])
    return path


def _convert(src: Path, dst: Path, *, dtype: str, bits: int | None) -> None:
    from mlx_lm import convert

    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), str(tmp), quantize=bits is not None, q_group_size=64 if bits else None,
                q_bits=bits, dtype=dtype)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def build_models(shape: str, formats: list[str], python: str, *, seed: int = 0,
                 root: Path | None = None, log=print) -> Path:
    """Writes (once; kept while ``spec.json`` matches) the shape's models for
    ``formats``, and the F16 pair the same-weights check reads, under ``root`` (default:
    the cache). Returns the directory."""
    from pyloader.compare.system import cache_dir

    config = shape_config(shape)
    root = Path(root) if root else cache_dir("llama-cpp-bench", shape)
    spec = {"shape": shape, "config": config, "seed": seed, "version": VERSION}
    marker = root / "spec.json"
    if marker.exists() and json.loads(marker.read_text()) != spec:
        log(f"  {root}: written for another spec, rewriting")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(spec, indent=1))
    f16 = root / "mlx-f16"
    if not (f16 / "config.json").exists():
        log(f"  writing {f16} ({n_params(config) / 1e9:.2f}e9 parameters)")
        write_float16_model(f16, config, seed)
    # The F16 pair is the same-weights check's whatever the formats (BF16 logits differ
    # between the engines by more than the tolerance: activations rounded to bfloat16).
    for fmt in ["f16", *(f for f in formats if f != "f16")]:
        _, stem, mlx_dir, _ = FORMATS[fmt]
        if mlx_dir is not None and not (root / mlx_dir / "config.json").exists():
            log(f"  writing {root / mlx_dir}")
            bits = {"q4": 4, "q8": 8}.get(fmt)
            _convert(f16, root / mlx_dir, dtype="bfloat16" if fmt == "bf16" else "float16",
                     bits=bits)
        gguf = root / f"{stem}.gguf"
        if not gguf.exists():
            if fmt in QUANTIZED:
                if not (root / "f16.gguf").exists():
                    log(f"  writing {root / 'f16.gguf'}")
                    run_engine(python, "write-gguf", str(f16), str(root / "f16.gguf"),
                            "--type", "f16")
                log(f"  quantizing {gguf}")
                run_engine(python, "quantize", str(root / "f16.gguf"), str(gguf),
                        "--ftype", stem)
            else:
                log(f"  writing {gguf}")
                run_engine(python, "write-gguf", str(f16), str(gguf), "--type", stem)
    return root


def mlx_weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads from an mlx-lm directory: every tensor,
    the embedding table's (weight, scales, biases) counting one row."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, t in header.items():
            nbytes = t["data_offsets"][1] - t["data_offsets"][0]
            if "embed_tokens" in name:
                nbytes //= t["shape"][0]
            total += nbytes
    return total
