"""A GGUF file as an mlx-lm model directory (:func:`convert_gguf`), and MLX's own GGUF reader
behind the header checks it needs (:func:`read_gguf`).

The conversion reads the file as :class:`~pyloader.io.gguf_source.GGUFSource` does for
``load_model``: every architecture and block format read in place converts, exactly. A
llama's Q/K rows are put back in Hugging Face order (:func:`unpermute_qk_rows`). See
docs/gguf.md.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .._native import core
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
from .gguf_affine import AFFINE_TYPES, GROUP_SIZE, to_affine
from .gguf_checks import Metadata, tokenizer_metadata
from .gguf_header import GGUFHeader, read_header
from .gguf_source import ARCHITECTURES, FLOAT_TYPES, GGUFSource
from .gguf_tokenizer import build_tokenizer, tokenizer_files
from .readers import MmapReader
from .writer import save_safetensors

log = logging.getLogger(__name__)


#: Accepted values of ``convert_gguf(dtype=...)``.
DTYPES = ("keep", "bf16", "f16", "f32")
_FLOAT_DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}
_SAFETENSORS_DTYPE_NAMES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}

#: ``general.architecture`` values the conversion maps (those read in place).
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
#: Architectures whose files store a norm's ``1 + weight``.
_ONE_PLUS_NORMS = frozenset({"gemma2", "gemma3"})


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
# Types MLX returns as float arrays: F32 and F16 as stored; BF16, Q2_K and Q6_K converted to
# float16 by MLX (BF16 values beyond float16's range would become infinite: checked).
_MLX_FLOAT_TYPES = ("F32", "F16", "BF16", "Q2_K", "Q6_K")
SUPPORTED_TYPES = tuple(QUANTIZED_TYPES) + _MLX_FLOAT_TYPES
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
            f"{path}: tensor types MLX's GGUF reader cannot read: {what}. Supported: "
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


def _exact_half(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) as float16 when every value is one, else as it is."""
    half = x.astype(np.float16)
    return half if np.isfinite(half).all() and np.array_equal(half, x) else x


def _convert_tensors(source: GGUFSource, dtype: str, unpermute_qk: bool
                     ) -> tuple[dict[str, mx.array], dict[str, int]]:
    """The file's tensors as mlx-lm's (dequantized or rewritten exactly, un-permuted, cast)
    and each quantized module's bits."""
    target = _FLOAT_DTYPES.get(dtype)
    heads = {"q_proj": source.config["num_attention_heads"],
             "k_proj": source.config["num_key_value_heads"]}
    out: dict[str, mx.array] = {}
    quant_bits: dict[str, int] = {}
    for name, arr in MmapReader(source.checkpoint).load().items():
        ggml_type, module = source.types[name], name.rpartition(".")[0]
        n_head = heads.get(module.rsplit(".", 1)[-1]) if unpermute_qk and \
            source.arch == "llama" else None

        def rows(x, n_head=n_head):
            return unpermute_qk_rows(x, n_head) if n_head else x

        if ggml_type in AFFINE_TYPES and target is None:
            packed, scales, biases = to_affine(np.asarray(arr), ggml_type)
            both = np.stack([scales, biases])
            scales, biases = _exact_half(both)  # MLX's own reader's dtype when exact
            quant_bits[module] = AFFINE_TYPES[ggml_type]
            out.update({name: mx.array(rows(packed)), f"{module}.scales": mx.array(rows(scales)),
                        f"{module}.biases": mx.array(rows(biases))})
            continue
        if ggml_type not in FLOAT_TYPES:  # exactly ggml's reference values, in float32
            arr = core.ggml_dequantize(arr, ggml_type, source.shapes[name][-1])
        w = rows(arr) if target is None else rows(arr).astype(target)
        if module.endswith("norm") and source.arch in _ONE_PLUS_NORMS:
            w = _gemma_norm(source.path, name, w)
        out[name] = w
    return out, quant_bits


def _gemma_norm(path: str, name: str, w: mx.array) -> mx.array:
    """A gemma norm's stored ``1 + weight`` as mlx-lm's ``weight`` (it adds the 1 back, in
    the weight's dtype): refused unless that gives back every stored value exactly."""
    weight = w - 1.0
    if not mx.array_equal(1.0 + weight, w).item():
        raise UnsupportedError(f"{path}: {name}: the stored norm (1 + weight) does not come "
                               "back exactly from weight as mlx-lm's gemma computes it; "
                               "load the file in place with pyloader.load_model")
    return weight


def quantization_config(quant_bits: dict[str, int], modules: list[str]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` block: the most common bit width as default, an entry per module of
    another width, ``False`` for modules left in floating point."""
    if not quant_bits:
        return None
    widths = sorted(quant_bits.values())
    default_bits = max(set(widths), key=widths.count)
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits}
    for module in modules:
        if module in quant_bits:
            if quant_bits[module] != default_bits:
                config[module] = {"group_size": GROUP_SIZE, "bits": quant_bits[module]}
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
    """Convert the GGUF file ``in_path`` into an mlx-lm model directory; returns it.

    ``dtype="keep"``: the block formats MLX computes exactly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q4_K, Q5_K) stay quantized in MLX's affine format; the others (Q2_K, Q3_K, Q6_K) become
    float32, their exact values; float tensors stay as they are. ``"bf16"``, ``"f16"``,
    ``"f32"``: every tensor dequantized exactly, then cast.

    Raises:
        pyloader.FormatError, pyloader.UnsupportedError: what ``load_model`` refuses in the
            file, and Llama 3.1-style RoPE factors (no mlx-lm config reproduces them
            exactly); nothing is written then.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    path = os.fspath(in_path)
    out = Path(out_dir)
    # Every value and tensor the conversion uses is checked before anything is written.
    source = GGUFSource.open(path)
    if source.rope_factors is not None:
        raise UnsupportedError(
            f"{path}: tensor 'rope_freqs.weight' (Llama 3.1-style RoPE factors): mlx-lm's "
            "config holds the scaling's parameters, not the factors, so the conversion "
            "cannot reproduce them exactly; load the file in place with pyloader.load_model")
    meta = Metadata(source.header, source.header.values or {})
    vocab_size, context = source.config["vocab_size"], source.config["max_position_embeddings"]
    tm = tokenizer_metadata(meta, vocab_size)
    tokenizer_texts, token_ids = tokenizer_files(meta, tm, build_tokenizer(meta, tm), context)
    tensors, quant_bits = _convert_tensors(source, dtype, _unpermute_qk)
    matrices = sorted({k.rsplit(".", 1)[0] for k, v in tensors.items()
                       if k.endswith(".weight") and v.ndim >= 2})
    quantization = quantization_config(quant_bits, matrices)
    carried = _carried_files(out)  # before writing anything: it may refuse

    type_counts: dict[str, int] = {}
    for t in source.header.tensors.values():
        type_counts[t.type_name] = type_counts.get(t.type_name, 0) + 1
    log.info("converting %s (%s; tensors: %s) to %s, dtype=%s", path, source.arch,
             ", ".join(f"{n} {t}" for t, n in sorted(type_counts.items())), out, dtype)

    config = {k: v for k, v in source.config.items() if k != "rope_traditional"}
    if source.arch == "llama" and config["model_type"] == "llama":
        config = {"architectures": ["LlamaForCausalLM"], **config, "hidden_act": "silu"}
    config.update((k, token_ids[k]) for k in ("bos_token_id", "eos_token_id") if k in token_ids)
    if dtype != "keep":
        config["torch_dtype"] = _SAFETENSORS_DTYPE_NAMES[_FLOAT_DTYPES[dtype]]
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    config["pyloader_gguf_source"] = {
        "file": os.path.basename(path),
        "name": meta.string("general.name", None),
        "license": meta.string("general.license", None),
        "dtype": dtype,
        "qk_unpermuted": _unpermute_qk,
    }
    files = {**tokenizer_texts, "config.json": json.dumps(config, indent=2, ensure_ascii=False)}
    _write(out, files, tensors, carried)
    log.info("wrote %s (%d tensors%s)", out, len(tensors),
             f", quantized {len(quant_bits)} modules" if quant_bits else "")
    return out


def _write(out: Path, files: dict[str, str], tensors: dict[str, mx.array],
           carried: list[str]) -> None:
    """``out`` made atomically: ``files``, ``model.safetensors`` and the ``carried`` files of
    the directory it replaces."""
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
