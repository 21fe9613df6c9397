"""A GGUF file read in place: its metadata as an mlx-lm config, its tensors as a
:class:`~pyloader.io.checkpoint.Checkpoint` under mlx-lm's names, its tokenizer.

A block-quantized tensor (Q4_K, Q6_K, ...) is a uint8 array of shape ``(rows, row bytes)``
whose rows are the file's blocks; a float tensor (F32, F16, BF16) keeps its dtype. Nothing
is converted or copied: the readers hand out views of the mapped file. See docs/gguf.md.
"""

from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._native import core
from ..errors import FormatError, UnsupportedError
from .checkpoint import Checkpoint
from .gguf_checks import (
    BLOCK_NAMES,
    GLOBAL_NAMES,
    Metadata,
    block_index,
    expected_shapes,
    llama_config,
    tokenizer_metadata,
)
from .gguf_header import GGML_TYPES, GGUFHeader, read_header
from .gguf_tokenizer import build_tokenizer, tokenizer_files

__all__ = ["ARCHITECTURES", "BLOCK_TYPES", "FLOAT_TYPES", "GGUFSource", "block_shape"]

#: ``general.architecture`` values read in place -> mlx-lm ``model_type``.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
#: ggml block formats computed in place by pyloader's CPU kernels.
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: ggml float types -> the safetensors dtype name of their elements.
FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}

#: GGUF block tensor -> mlx-lm module: the conversion's, and Qwen3's Q/K norms.
_BLOCK = {**BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BY_TYPE_NAME = {name: (block, nbytes) for name, block, nbytes in GGML_TYPES.values()}


def block_shape(type_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 shape of a ``type_name`` tensor of logical ``shape`` (rows, row bytes)."""
    block, nbytes = _BY_TYPE_NAME[type_name]
    *outer, k = shape
    return (*outer, k // block * nbytes)


def _mlx_name(path: str, name: str, n_layer: int) -> str:
    base, dot, part = name.rpartition(".")
    if not dot or part not in ("weight", "bias"):
        raise UnsupportedError(f"{path}: tensor {name!r} has no mlx-lm counterpart")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{part}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK:
        i = block_index(path, name, parts[1], n_layer)
        return f"model.layers.{i}.{_BLOCK[parts[2]]}.{part}"
    raise UnsupportedError(f"{path}: tensor {name!r} has no mlx-lm counterpart")


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file as pyloader reads it in place.

    Attributes:
        path: The file.
        header: Its checked header, with the metadata values.
        arch: ``general.architecture``.
        config: The mlx-lm config (``config.json``'s content) the metadata describes.
        checkpoint: The tensors under mlx-lm's parameter names (regions of the file).
        types: mlx-lm parameter name -> ggml type name (``"Q4_K"``, ``"F32"``, ...).
        shapes: mlx-lm parameter name -> the tensor's logical (row-major) shape.
        rope_factors: ``rope_freqs.weight`` (Llama 3.1-style RoPE scaling): pair i of each
            head turns ``factor[i]`` times slower; None without it.
    """

    path: str
    header: GGUFHeader
    arch: str
    config: dict[str, Any]
    checkpoint: Checkpoint
    types: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    rope_factors: tuple[float, ...] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFSource:
        """Read and check ``path``'s header and metadata (no tensor data is read).

        Raises:
            pyloader.FormatError: a broken header or metadata (naming the key or tensor).
            pyloader.UnsupportedError: an architecture, tensor or type not read in place.
        """
        path = os.fspath(path)
        header = read_header(path, values=True)
        meta = Metadata(header, header.values or {})
        arch = meta.string("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedError(
                f"{path}: GGUF architecture {arch!r} is not read in place (supported: "
                f"{', '.join(ARCHITECTURES)})")
        c = llama_config(meta, arch)
        regions, types, shapes = [], {}, {}
        factors = None
        for name, t in header.tensors.items():
            if name == "rope_freqs.weight":
                factors = _rope_factors(path, t, c.head_dim)
                continue
            mlx_name = _mlx_name(path, name, c.n_layer)
            if mlx_name in types:
                raise FormatError(f"{path}: tensor {name!r} maps to {mlx_name}, as another "
                                  "tensor does")
            if t.type_name in FLOAT_TYPES:
                dtype, shape = FLOAT_TYPES[t.type_name], t.shape
            elif t.type_name in BLOCK_TYPES:
                if len(t.shape) != 2 or name.endswith(".bias"):
                    raise UnsupportedError(f"{path}: tensor {name!r}: a {t.type_name} tensor "
                                           f"of shape {t.shape}; block formats are read "
                                           "for matrices only")
                dtype, shape = "U8", block_shape(t.type_name, t.shape)
            else:
                raise UnsupportedError(
                    f"{path}: tensor {name!r} is {t.type_name}, which pyloader does not "
                    f"compute (supported: {', '.join((*FLOAT_TYPES, *BLOCK_TYPES))})")
            regions.append((mlx_name, dtype, list(shape), t.offset, t.nbytes))
            types[mlx_name], shapes[mlx_name] = t.type_name, t.shape
        if "model.embed_tokens.weight" not in shapes:
            raise FormatError(f"{path}: no token_embd.weight")
        _check_sizes(meta, arch, c, shapes)
        vocab = shapes["model.embed_tokens.weight"][0]
        expected = expected_shapes(c, vocab)
        for name, t in header.tensors.items():
            kind = ".".join(name.split(".")[-2:])
            if kind in expected and t.shape != expected[kind]:
                raise FormatError(f"{path}: tensor {name!r}: shape {t.shape}, but the metadata "
                                  f"makes it {expected[kind]}")
        config = _config(arch, c, vocab, tied="lm_head.weight" not in shapes,
                         biased="model.layers.0.self_attn.q_proj.bias" in shapes)
        ckpt = Checkpoint.of_index(path, core.TensorIndex.of_regions(
            path, header.data_offset, regions))
        return cls(path, header, arch, config, ckpt, types, shapes, factors)

    def tokenizer(self, tokenizer_config: dict[str, Any] | None = None):
        """mlx-lm's tokenizer (``TokenizerWrapper``) rebuilt from ``tokenizer.ggml.*``; None
        for a file without one (``tokenizer.ggml.model`` absent or ``"none"``)."""
        from mlx_lm.utils import load_tokenizer

        meta = Metadata(self.header, self.header.values or {})
        if meta.string("tokenizer.ggml.model", "none") == "none":
            return None
        tm = tokenizer_metadata(meta, self.config["vocab_size"])
        files, ids = tokenizer_files(meta, tm, build_tokenizer(meta, tm),
                                     self.config["max_position_embeddings"])
        with tempfile.TemporaryDirectory(prefix="pyloader-gguf-tokenizer-") as tmp:
            for name, text in files.items():
                (Path(tmp) / name).write_text(text)
            return load_tokenizer(Path(tmp), tokenizer_config,
                                  eos_token_ids=ids.get("eos_token_id"))


def _check_sizes(meta: Metadata, arch: str, c, shapes: dict[str, tuple[int, ...]]) -> None:
    """The metadata's block count and width against the tensors, before a model of that
    size is built."""
    blocks = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")}
    if len(blocks) != c.n_layer or max(blocks, default=-1) != c.n_layer - 1:
        have = f"blocks {min(blocks)}-{max(blocks)}" if blocks else "no block"
        raise meta.fail(f"{arch}.block_count",
                        f"{c.n_layer} blocks, but the file's tensors hold {have}")
    embd = shapes["model.embed_tokens.weight"]
    if len(embd) != 2 or embd[1] != c.hidden:
        raise meta.fail(f"{arch}.embedding_length",
                        f"width {c.hidden}, but token_embd.weight is {embd}")


def _rope_factors(path: str, t, head_dim: int) -> tuple[float, ...]:
    """``rope_freqs.weight``: one finite positive float32 factor per rotated pair."""
    where = f"{path}: tensor 'rope_freqs.weight'"
    if t.type_name != "F32" or t.shape != (head_dim // 2,):
        raise FormatError(f"{where}: {t.type_name} of shape {t.shape}, not F32 of "
                          f"({head_dim // 2},), one factor per rotated pair")
    values = np.fromfile(path, dtype="<f4", count=head_dim // 2, offset=t.offset)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise FormatError(f"{where}: a factor that is not a finite positive number")
    return tuple(float(v) for v in values)


def _config(arch: str, c, vocab: int, *, tied: bool, biased: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_head_kv,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.context_length,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }
    if arch == "llama":
        # llama.cpp stores a llama's Q and K rows permuted for its adjacent-pair RoPE: with
        # MLX's traditional RoPE the scores are those of the Hugging Face model.
        config.update(rope_traditional=True, attention_bias=biased, mlp_bias=False)
    return copy.deepcopy(config)
