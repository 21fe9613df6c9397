"""A GGUF file read in place: its metadata as an mlx-lm config, its tensors as a
:class:`~pyloader.io.checkpoint.Checkpoint` under mlx-lm's names, its tokenizer.

A block-quantized tensor (Q4_K, Q6_K, ...) is a uint8 array of shape ``(rows, row bytes)``
whose rows are the file's blocks; a float tensor (F32, F16, BF16) keeps its dtype. Nothing
is converted or copied: the readers hand out views of the mapped file. See docs/gguf.md.
"""

from __future__ import annotations

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

#: ``general.architecture`` values read in place -> mlx-lm ``model_type``.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                 "gemma2": "gemma2", "gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
#: Architectures whose files may hold a mixture of experts (a llama one is a mixtral).
_EXPERTS = frozenset({"llama", "qwen3moe"})
#: ggml block formats computed in place by pyloader's CPU kernels.
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: ggml float types -> the safetensors dtype name of their elements.
FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}

#: GGUF block tensor -> mlx-lm module: the conversion's, and Qwen3's Q/K norms.
_BLOCK = {**BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: Architectures whose blocks name some tensors otherwise: phi3 fuses Q, K and V, and gate and
#: up, as mlx-lm's phi3 does; gemma2 and gemma3 have a norm before and after each half of a
#: block.
_BLOCK_BY_ARCH = {
    "phi3": {**_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma3": {**_BLOCK, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_BLOCK_BY_ARCH["gemma2"] = _BLOCK_BY_ARCH["gemma3"]


def _moe_blocks(moe: str) -> dict[str, str]:
    """A mixture-of-experts block's names: the router and the experts' stacked matrices under
    mlx-lm's ``moe`` module."""
    return {**_BLOCK, "ffn_gate_inp": f"{moe}.gate",
            **{f"ffn_{p}_exps": f"{moe}.switch_mlp.{p}_proj" for p in ("gate", "up", "down")}}


_BLOCK_BY_ARCH["qwen3moe"] = _moe_blocks("mlp")
_MIXTRAL = _moe_blocks("block_sparse_moe")
_ATTN = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
_FFN = ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_MOE = ("ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_QK_NORM = ("attn_q_norm", "attn_k_norm")
_GEMMA_NORMS = ("post_attention_norm", "post_ffw_norm")
#: Each block's tensors in mlx-lm's model of an architecture (``.weight`` unless a ``.bias``
#: is named; a llama with experts is a mixtral).
_BLOCK_TENSORS = {
    "llama": _ATTN + _FFN, "mixtral": _ATTN + _MOE,
    "qwen2": _ATTN + _FFN + ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": _ATTN + _QK_NORM + _FFN, "qwen3moe": _ATTN + _QK_NORM + _MOE,
    "phi3": ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"),
    "gemma2": _ATTN + _FFN + _GEMMA_NORMS, "gemma3": _ATTN + _QK_NORM + _FFN + _GEMMA_NORMS,
}
#: A llama's attention biases: in every projection of every block, or in none.
_LLAMA_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
#: llama.cpp's fixed gemma3 settings, which its files do not store: every 6th layer attends
#: globally, the others in the sliding window with RoPE base 10000.
_GEMMA3 = {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}
#: Architectures whose RoPE may rotate part of a head.
_PARTIAL_ROPE = frozenset({"phi3"})
_BY_TYPE_NAME = {name: (block, nbytes) for name, block, nbytes in GGML_TYPES.values()}


def block_shape(type_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 shape of a ``type_name`` tensor of logical ``shape`` (rows, row bytes)."""
    block, nbytes = _BY_TYPE_NAME[type_name]
    *outer, k = shape
    return (*outer, k // block * nbytes)


def _mlx_name(path: str, name: str, n_layer: int, blocks: dict[str, str]) -> str:
    base, dot, part = name.rpartition(".")
    if not dot or part not in ("weight", "bias"):
        raise UnsupportedError(f"{path}: tensor {name!r} has no mlx-lm counterpart")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{part}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in blocks:
        i = block_index(path, name, parts[1], n_layer)
        return f"model.layers.{i}.{blocks[parts[2]]}.{part}"
    if len(parts) == 4 and parts[0] == "blk" and parts[3].isdigit():
        raise UnsupportedError(f"{path}: tensor {name!r}: one expert's own tensor (the layout "
                               "of early mixtral GGUFs); experts are read stacked, as "
                               "llama.cpp's converter writes them now (ffn_*_exps)")
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
        c = llama_config(meta, arch, partial_rope=arch in _PARTIAL_ROPE,
                         experts=arch in _EXPERTS)
        if arch == "qwen3moe" and not c.n_expert:
            raise meta.fail("qwen3moe.expert_count", "no experts, where a qwen3moe has some")
        blocks = _MIXTRAL if arch == "llama" and c.n_expert else _BLOCK_BY_ARCH.get(arch, _BLOCK)
        regions, types, shapes = [], {}, {}
        factors = None
        for name, t in header.tensors.items():
            if name == "rope_freqs.weight":
                factors = _rope_factors(path, t, c.head_dim)
                continue
            mlx_name = _mlx_name(path, name, c.n_layer, blocks)
            if mlx_name in types:
                raise FormatError(f"{path}: tensor {name!r} maps to {mlx_name}, as another "
                                  "tensor does")
            if t.type_name in FLOAT_TYPES:
                dtype, shape = FLOAT_TYPES[t.type_name], t.shape
            elif t.type_name in BLOCK_TYPES:
                if len(t.shape) != (3 if name.endswith("_exps.weight") else 2) or \
                        name.endswith(".bias"):
                    raise UnsupportedError(f"{path}: tensor {name!r}: a {t.type_name} tensor "
                                           f"of shape {t.shape}; block formats are read "
                                           "for matrices (and stacks of experts) only")
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
        _check_complete(path, "mixtral" if arch == "llama" and c.n_expert else arch,
                        c.n_layer, set(header.tensors))
        vocab = shapes["model.embed_tokens.weight"][0]
        expected = expected_shapes(c, vocab, arch)
        for name, t in header.tensors.items():
            kind = ".".join(name.split(".")[-2:])
            if kind in expected and t.shape != expected[kind]:
                raise FormatError(f"{path}: tensor {name!r}: shape {t.shape}, but the metadata "
                                  f"makes it {expected[kind]}")
        config = _config(meta, arch, c, vocab, tied="lm_head.weight" not in shapes,
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


def _check_complete(path: str, model: str, n_layer: int, names: set[str]) -> None:
    """The file holds the tensors of mlx-lm's ``model`` and no other: every block's,
    ``token_embd`` and ``output_norm``, ``output`` unless the embedding is tied (a gemma2
    always ties it)."""
    kinds = [k if "." in k else f"{k}.weight" for k in _BLOCK_TENSORS[model]]
    if model == "llama" and "blk.0.attn_q.bias" in names:
        kinds += _LLAMA_BIASES
    expected = {"token_embd.weight", "output_norm.weight",
                *(f"blk.{i}.{k}" for i in range(n_layer) for k in kinds)}
    missing = sorted(expected - names)
    if missing:
        raise FormatError(f"{path}: no tensor {missing[0]!r}, which mlx-lm's {model} model "
                          f"has ({len(missing)} missing)")
    optional = {"rope_freqs.weight"} | (set() if model == "gemma2" else {"output.weight"})
    extra = sorted(names - expected - optional)
    if extra:
        raise UnsupportedError(f"{path}: tensor {extra[0]!r} has no parameter in mlx-lm's "
                               f"{model} model")


def _moe_config(meta: Metadata, arch: str, c) -> dict[str, Any]:
    """A mixture of experts' config: llama.cpp routes a token to its top experts by the
    softmax of the router's scores, renormalized over those chosen (qwen3moe and mixtral
    alike: for mixtral that is the softmax over the chosen scores, as mlx-lm computes it)."""
    if arch == "qwen3moe":
        return {"num_experts": c.n_expert, "num_experts_per_tok": c.n_expert_used,
                "moe_intermediate_size": c.expert_ffn, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": True}
    # A llama with experts: mlx-lm's mixtral, whose experts' width is its intermediate size
    # and whose head size is the width over the heads.
    if c.head_dim * c.n_head != c.hidden:
        raise meta.fail("llama.attention.key_length",
                        f"head size {c.head_dim} is not the width {c.hidden} over {c.n_head} "
                        "heads, as mlx-lm's mixtral computes it")
    return {"model_type": "mixtral", "num_local_experts": c.n_expert,
            "num_experts_per_tok": c.n_expert_used, "intermediate_size": c.expert_ffn}


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


def _config(meta: Metadata, arch: str, c, vocab: int, *, tied: bool,
            biased: bool) -> dict[str, Any]:
    config = {"model_type": ARCHITECTURES[arch], **c.hf_config(vocab, tied=tied)}
    if c.n_expert:
        config.update(_moe_config(meta, arch, c))
    if arch == "llama":
        # llama.cpp stores a llama's Q and K rows permuted for its adjacent-pair RoPE: with
        # MLX's traditional RoPE the scores are those of the Hugging Face model.
        config.update(rope_traditional=True, attention_bias=biased, mlp_bias=False)
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales the 27B models' queries (gemma2: 46 layers, gemma3: 62) by the
        # width per head, the others' by the head size; the files do not store it.
        big = c.n_layer == (46 if arch == "gemma2" else 62)
        config["query_pre_attn_scalar"] = c.hidden // c.n_head if big else c.head_dim
    if arch == "gemma2":
        config.update(
            attn_logit_softcapping=meta.real("gemma2.attn_logit_softcapping", 50.0),
            final_logit_softcapping=meta.real("gemma2.final_logit_softcapping", 30.0))
    if arch == "gemma3":
        pattern = _GEMMA3["sliding_window_pattern"]
        if c.n_layer < pattern:
            raise UnsupportedError(f"{meta.path}: a gemma3 of {c.n_layer} blocks "
                                   f"(gemma3.block_count); mlx-lm's gemma3 needs at least "
                                   f"{pattern}, its first global layer being block {pattern}")
        config.update(_GEMMA3, sliding_window=meta.integer("gemma3.attention.sliding_window"))
    if arch == "phi3":
        # mlx-lm's phi3 takes the head size as width / heads and rotates a fraction of it.
        if c.head_dim * c.n_head != c.hidden:
            raise meta.fail("phi3.attention.key_length",
                            f"head size {c.head_dim} is not the width {c.hidden} over "
                            f"{c.n_head} heads, as mlx-lm's phi3 computes it")
        if c.rope_scaling is not None:
            raise UnsupportedError(f"{meta.path}: phi3 RoPE scaling is not read in place")
        if int(c.head_dim * (c.rope_dim / c.head_dim)) != c.rope_dim:
            raise UnsupportedError(f"{meta.path}: RoPE over {c.rope_dim} of {c.head_dim} "
                                   "head dimensions is not a fraction mlx-lm's phi3 recovers")
        config.update(partial_rotary_factor=c.rope_dim / c.head_dim,
                      original_max_position_embeddings=meta.integer(
                          "phi3.rope.scaling.original_context_length", c.context_length))
    return config
