"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

Types MLX cannot read correctly are refused (:class:`pyloader.UnsupportedError`) from the
header, before MLX reads the file; Q/K rows are put back in Hugging Face order
(:func:`unpermute_qk_rows`). See docs/default-model.md.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import mlx.core as mx

from .._util.fs import (
    fault_point,
    named_errors,
    remove,
    remove_stale,
    replace_dir,
    tmp_sibling,
)
from ..errors import FormatError, UnsupportedError
from .config import SIDE_FILES
from .gguf_checks import (
    LlamaConfig,
    Metadata,
    check_tensors,
    llama_config,
    module_path,
    tokenizer_metadata,
)
from .gguf_header import GGUFHeader, read_header
from .gguf_tokenizer import build_tokenizer, tokenizer_files
from .writer import save_safetensors

log = logging.getLogger(__name__)


#: Accepted values of ``convert_gguf(dtype=...)``.
DTYPES = ("keep", "bf16", "f16", "f32")
_FLOAT_DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}
_SAFETENSORS_DTYPE_NAMES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}

#: ``general.architecture`` values this converter knows how to map.
SUPPORTED_ARCHITECTURES = ("llama",)

#: The block size of every GGUF type MLX decodes into quantized triples (Q4_0, Q4_1, Q8_0).
GGUF_GROUP_SIZE = 32

_NORMS = {"model.norm", "input_layernorm", "post_attention_layernorm"}


# Q/K row order


def _check_rows(x: mx.array, n_head: int) -> int:
    rows = x.shape[0]
    if n_head <= 0 or rows % n_head or (rows // n_head) % 2:
        raise ValueError(
            f"cannot reorder {rows} rows as {n_head} heads of an even head size")
    return rows // n_head


def permute_qk_rows(x: mx.array, n_head: int) -> mx.array:
    """Hugging Face row order -> llama.cpp (GGUF) row order, head by head."""
    d = _check_rows(x, n_head)
    rest = tuple(x.shape[1:])
    return x.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2).reshape(x.shape)


def unpermute_qk_rows(x: mx.array, n_head: int) -> mx.array:
    """llama.cpp (GGUF) row order -> Hugging Face order; inverse of :func:`permute_qk_rows`."""
    d = _check_rows(x, n_head)
    rest = tuple(x.shape[1:])
    return x.reshape(n_head, d // 2, 2, *rest).swapaxes(1, 2).reshape(x.shape)


# Reading

# MLX's GGUF reader decodes Q4_K wrongly and drops unknown types silently, so the types are
# checked from the header before MLX reads the file (docs/default-model.md).
#: Types MLX returns as affine-quantized (weight, scales, biases), group size 32: type -> bits.
QUANTIZED_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
#: Types MLX returns as float arrays: F32 and F16 as stored; BF16, Q2_K and Q6_K converted to
#: float16 by MLX (BF16 values beyond float16's range would become infinite: checked).
FLOAT_TYPES = ("F32", "F16", "BF16", "Q2_K", "Q6_K")
SUPPORTED_TYPES = tuple(QUANTIZED_TYPES) + FLOAT_TYPES
#: MLX builds shapes from 32-bit ints.
MLX_MAX_DIMENSION = 2**31 - 1


def read_tensor_types(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor name: (type name, row-major shape)}`` from a GGUF file's header."""
    return {n: (t.type_name, t.shape) for n, t in read_header(path).tensors.items()}


def check_for_mlx(header: GGUFHeader) -> None:
    """Refuse (:class:`pyloader.UnsupportedError`) what MLX's GGUF reader would misread: types
    outside :data:`SUPPORTED_TYPES`, dimensions above 32 bits, float64 or nested metadata arrays,
    quantized tensors whose names MLX would split wrongly."""
    path = header.path
    bad: dict[str, list[str]] = {}
    for name, t in header.tensors.items():
        if t.type_name not in SUPPORTED_TYPES:
            bad.setdefault(t.type_name, []).append(name)
    if bad:
        what = "; ".join(
            f"{t}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
            f"({len(names)} tensor{'s' if len(names) > 1 else ''})"
            for t, names in sorted(bad.items()))
        raise UnsupportedError(
            f"{path}: tensor types this converter cannot read: {what}. Supported: "
            f"{', '.join(SUPPORTED_TYPES)}. Re-quantize the model to one of them (for example "
            "with llama.cpp's llama-quantize to Q8_0 or Q4_0).")
    for key in header.value_types:
        if "float64" in header.value_types[key]:
            # MLX reads float64 as 4 bytes, misreading everything after it.
            raise UnsupportedError(
                f"{path}: metadata key {key!r}: a {header.value_types[key]} value, which "
                "MLX's GGUF reader misreads (and then the rest of the header)")
        if header.value_types[key].startswith("array[array"):
            raise UnsupportedError(
                f"{path}: metadata key {key!r}: {header.value_types[key]} (arrays of arrays), "
                "which MLX's GGUF reader does not read")
    names = set(header.tensors)
    for name, t in header.tensors.items():
        if any(d > MLX_MAX_DIMENSION for d in t.shape):
            raise UnsupportedError(f"{path}: tensor {name!r}: shape {t.shape} has a dimension "
                                   f"above {MLX_MAX_DIMENSION}, MLX's largest")
        if t.type_name not in QUANTIZED_TYPES:
            continue
        # MLX names the parts <name minus its last 7 characters>.scales/.biases.
        if not name.endswith(".weight"):
            raise UnsupportedError(f"{path}: tensor {name!r}: a {t.type_name} tensor's name "
                                   "must end in '.weight' (MLX names its scales and biases "
                                   "after that suffix)")
        base = name[: -len(".weight")]
        for part in (f"{base}.scales", f"{base}.biases"):
            if part in names:
                raise UnsupportedError(f"{path}: tensor {part!r}: the name MLX gives the "
                                       f"{part.rsplit('.', 1)[1]} of {t.type_name} tensor "
                                       f"{name!r} is taken")


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """``(tensors, metadata)`` of a GGUF file; see :func:`_read_checked`."""
    weights, metadata, _header = _read_checked(path)
    return weights, metadata


def _read_checked(path: str | os.PathLike):
    """``mx.load(path, return_metadata=True)`` once the header shows only supported types."""
    path = os.fspath(path)
    header = read_header(path)
    check_for_mlx(header)
    try:
        weights, metadata = mx.load(path, format="gguf", return_metadata=True)
    except Exception as exc:  # MLX raises ValueError/RuntimeError with its own text
        raise FormatError(f"{path}: MLX cannot read this GGUF file ({exc})") from exc

    for name, t in header.tensors.items():
        tname = t.type_name
        if tname in QUANTIZED_TYPES:
            base = name.removesuffix(".weight")
            present = name in weights and f"{base}.scales" in weights
        else:
            present = name in weights
        if not present:
            raise FormatError(f"{path}: MLX did not return tensor '{name}' ({tname})")
        if tname == "BF16" and not mx.all(mx.isfinite(weights[name])).item():
            raise UnsupportedError(
                f"{path}: BF16 tensor '{name}' has values outside float16's range, and MLX "
                "reads GGUF BF16 as float16")
    return weights, metadata, header


# Tensors


def _split_name(name: str) -> tuple[str, str]:
    for suffix in (".weight", ".scales", ".biases", ".bias"):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix[1:]
    return name, ""


def _bits(weight: mx.array, scales: mx.array, name: str, expected: int) -> int:
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    bits, rem = divmod(weight.shape[-1] * 32, in_features)
    if rem or bits != expected:
        raise FormatError(
            f"quantized tensor '{name}': packed shape {tuple(weight.shape)} and scales "
            f"{tuple(scales.shape)} are not {expected}-bit groups of {GGUF_GROUP_SIZE}")
    return bits


def _convert_tensors(weights: dict[str, mx.array], header: GGUFHeader, path: str, dtype: str,
                     c: LlamaConfig, unpermute_qk: bool
                     ) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Renamed (un-permuted, dequantized, cast) tensors and each quantized module's bits."""
    groups: dict[str, dict[str, mx.array]] = {}
    for name, arr in weights.items():
        base, part = _split_name(name)
        if not part:
            raise UnsupportedError(f"{path}: tensor '{name}' has no mlx-lm llama counterpart")
        groups.setdefault(base, {})[part] = arr

    target = _FLOAT_DTYPES.get(dtype)
    out: dict[str, mx.array] = {}
    quant_bits: dict[str, int] = {}
    for base, parts in groups.items():
        module = module_path(base, c.n_layer, path)
        quantized = "scales" in parts
        if quantized and not {"weight", "biases"} <= parts.keys():
            raise FormatError(f"{path}: quantized tensor '{base}' lacks weight or biases")
        if not quantized and "biases" in parts:
            raise FormatError(f"{path}: tensor '{base}' has biases but no scales")
        if "weight" not in parts:
            raise FormatError(f"{path}: tensor '{base}' has no weight")

        if unpermute_qk and base.endswith((".attn_q", ".attn_k")):
            heads = c.n_head if base.endswith(".attn_q") else c.n_head_kv
            parts = {k: unpermute_qk_rows(v, heads) for k, v in parts.items()}

        if quantized:
            bits = _bits(parts["weight"], parts["scales"], base,
                         QUANTIZED_TYPES[header.tensors[f"{base}.weight"].type_name])
            if target is None:
                quant_bits[module] = bits
                out.update((f"{module}.{k}", parts[k]) for k in ("weight", "scales", "biases"))
            else:
                # In float32, so the only rounding is the final cast to the target type.
                w = mx.dequantize(parts["weight"], parts["scales"].astype(mx.float32),
                                  parts["biases"].astype(mx.float32),
                                  group_size=GGUF_GROUP_SIZE, bits=bits)
                out[f"{module}.weight"] = w.astype(target)
        else:
            w = parts["weight"]
            if not mx.issubdtype(w.dtype, mx.floating):
                raise UnsupportedError(
                    f"{path}: tensor '{base}.weight' has dtype {w.dtype}, not a float type")
            out[f"{module}.weight"] = w if target is None else w.astype(target)
        if "bias" in parts:
            b = parts["bias"]
            out[f"{module}.bias"] = b if target is None else b.astype(target)
    return out, quant_bits


def quantization_config(quant_bits: dict[str, int], modules: list[str]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` block: the most common bit width as default, an entry per module of
    another width, ``False`` for modules left in floating point."""
    if not quant_bits:
        return None
    widths = sorted(quant_bits.values())
    default_bits = max(set(widths), key=widths.count)
    config: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for module in modules:
        if module in quant_bits:
            if quant_bits[module] != default_bits:
                config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": quant_bits[module]}
        else:
            config[module] = False
    return config


# Conversion


def convert_gguf(
    in_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "keep",
    *,
    _unpermute_qk: bool = True,
) -> Path:
    """Convert the llama GGUF file ``in_path`` into an mlx-lm model directory; returns it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    path = os.fspath(in_path)
    out = Path(out_dir)

    weights, metadata, header = _read_checked(path)
    # Every value and tensor the conversion uses is checked before anything is written.
    meta = Metadata(header, metadata)
    arch = meta.string("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    c = llama_config(meta, arch)
    vocab_size = check_tensors(header, c, QUANTIZED_TYPES)
    tm = tokenizer_metadata(meta, vocab_size)
    tokenizer_json = build_tokenizer(meta, tm)
    source_name = meta.string("general.name", None)
    source_license = meta.string("general.license", None)
    tie = "output.weight" not in weights

    tensors, quant_bits = _convert_tensors(weights, header, path, dtype, c, _unpermute_qk)
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight")})
    linear_modules = [m for m in modules if m.rsplit(".", 1)[-1] not in
                      {n.rsplit(".", 1)[-1] for n in _NORMS}]
    quantization = quantization_config(quant_bits, linear_modules)
    has_attn_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    tokenizer_texts, token_ids = tokenizer_files(meta, tm, tokenizer_json, c.context_length)
    carried = _carried_files(out)  # before writing anything: it may refuse

    type_counts: dict[str, int] = {}
    for t in header.tensors.values():
        type_counts[t.type_name] = type_counts.get(t.type_name, 0) + 1
    log.info("converting %s (%s; tensors: %s) to %s, dtype=%s", path, arch,
             ", ".join(f"{n} {t}" for t, n in sorted(type_counts.items())), out, dtype)

    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                              **c.hf_config(vocab_size, tied=tie), "hidden_act": "silu",
                              "attention_bias": has_attn_bias, "mlp_bias": False}
    if "bos_token_id" in token_ids:
        config["bos_token_id"] = token_ids["bos_token_id"]
    if "eos_token_id" in token_ids:
        config["eos_token_id"] = token_ids["eos_token_id"]
    if dtype != "keep":
        config["torch_dtype"] = _SAFETENSORS_DTYPE_NAMES[_FLOAT_DTYPES[dtype]]
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    source = {
        "file": os.path.basename(path),
        "name": source_name,
        "license": source_license,
        "dtype": dtype,
        "qk_unpermuted": _unpermute_qk,
    }
    config["pyloader_gguf_source"] = source
    files = {**tokenizer_texts, "config.json": json.dumps(config, indent=2, ensure_ascii=False)}

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = tmp_sibling(out, "tmp")
    remove(tmp)
    try:
        tmp.mkdir()
        for name, text in files.items():
            with named_errors(out / name):
                (tmp / name).write_text(text)
            fault_point(f"wrote {tmp / name}")
        # Natural layout: every tensor zero-copy under mmap, and mlx_lm.load reads it unchanged.
        try:
            save_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "mlx"})
        except OSError as exc:  # name the file asked for, not the temporary
            raise OSError(exc.errno, exc.strerror, str(out / "model.safetensors")) from exc
        for name in carried:  # never a name written above (_is_model_file)
            os.link(out / name, tmp / name, follow_symlinks=False)
        fault_point(f"built {tmp}")
        if out.exists():
            replace_dir(tmp, out)
        else:
            os.rename(tmp, out)
            fault_point(f"renamed {tmp.name} to {out}")
    except BaseException:
        remove(tmp)
        raise
    log.info("wrote %s (%d tensors%s)", out, len(tensors),
             f", quantized {len(quant_bits)} modules" if quant_bits else "")
    return out


#: Model files (config, tokenizer and processor files): an existing output directory's files of
#: these names (and its ``*.safetensors``, index) are not carried into the converted one.
MODEL_FILE_NAMES = frozenset({"config.json", *SIDE_FILES, "vocab.txt",
                              "preprocessor_config.json", "processor_config.json"})


def _is_model_file(name: str) -> bool:
    return name in MODEL_FILE_NAMES or name.endswith((".safetensors", ".safetensors.index.json"))


def _carried_files(out: Path) -> list[str]:
    """Files of an existing ``out`` the conversion keeps (non-model files); refuses a bad
    ``out``."""
    if not (out.exists() or out.is_symlink()):
        return []
    if not out.is_dir() or out.is_symlink():
        raise FileExistsError(17, "the output exists and is not a directory", str(out))
    entries = list(out.iterdir())
    if any(e.is_dir() and not e.is_symlink() for e in entries):
        raise FileExistsError(17, "the output directory has subdirectories, which the "
                              "conversion cannot carry over in one step; convert into a "
                              "new directory", str(out))
    return sorted(e.name for e in entries if not _is_model_file(e.name))
