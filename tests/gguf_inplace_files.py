"""Small GGUF files in llama.cpp's block formats, written with llama.cpp's gguf-py, and their
exact float weights (gguf-py's reference dequantization) for the in-place tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the test extra's gguf (llama.cpp's gguf-py)")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

#: Types gguf-py quantizes; the K-quants (which it only dequantizes) get random blocks.
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16")
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TOKENS = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
          + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġa", "ab"])
SIZES = {"hidden": 256, "n_head": 4, "n_kv": 2, "head_dim": 64, "ffn": 512, "n_layer": 2}
#: A mixture of experts' sizes (``experts=True``): 4 experts of width 256, 2 per token.
EXPERTS = {"n_expert": 4, "n_used": 2, "expert_ffn": 256}


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, k: int) -> np.ndarray:
    """Random blocks of a K-quant with small finite half-precision scales (d, dmin)."""
    qt = Q[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.01, size=(rows, k // block, 2)).astype(np.float16)
    where = {"Q2_K": nbytes - 4, "Q3_K": nbytes - 2, "Q4_K": 0, "Q5_K": 0, "Q6_K": nbytes - 2}
    at = where[type_name]
    count = 2 if type_name in ("Q2_K", "Q4_K", "Q5_K") else 1
    raw[..., at:at + 2 * count] = halves[..., :count].view(np.uint8).reshape(
        rows, k // block, 2 * count)
    return raw.reshape(rows, -1)


def random_halves(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float16 values of random sign and mantissa, magnitudes in [1/32, 1/8), drawn as bits:
    a large file's matrices without numpy's slow float conversions."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= 0x87FF  # sign, the exponent's lowest bit, mantissa
    bits |= 0x2800  # exponent 10 or 11 (of bias 15)
    return bits.view(np.float16)


def encode(rng: np.random.Generator, type_name: str,
           w: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``(stored, exact)``: ``w`` in ``type_name`` as the file stores it, and its exact float32
    values (gguf-py's dequantization)."""
    if type_name == "F32":
        return w.astype(np.float32), w.astype(np.float32)
    if type_name == "F16":
        half = w.astype(np.float16)
        return half, half.astype(np.float32)
    if type_name in QUANTIZABLE:
        stored = quantize(w.astype(np.float32), Q[type_name])
    elif type_name in BLOCK_TYPES:  # a stack of experts: its matrices' rows one after another
        rows = random_blocks(rng, type_name, int(np.prod(w.shape[:-1])), w.shape[-1])
        stored = rows.reshape(*w.shape[:-1], -1)
    else:  # a type pyloader refuses: any bytes of the right size
        block, nbytes = gguf.GGML_QUANT_SIZES[Q[type_name]]
        stored = rng.integers(0, 256, (w.shape[0], w.shape[1] // block * nbytes), np.uint8)
        return stored, None
    return stored, dequantize(stored, Q[type_name]).astype(np.float32).reshape(w.shape)


def write_model(path: Path, arch: str = "llama", linear: str = "Q4_0", embed: str = "Q8_0",
                *, tied: bool = False, seed: int = 0,
                types: dict[str, str] | None = None,
                tokenizer: dict | None = None,
                rope_factors: np.ndarray | None = None,
                sizes: dict | None = None,
                rope_dim: int | None = None,
                experts: bool = False,
                with_exact: bool = True) -> dict[str, np.ndarray]:
    """A tiny random ``arch`` GGUF with linear weights in ``linear`` and the embedding in
    ``embed`` (``types``: other types for named tensors, None to leave one out; ``tokenizer``: ``tokenizer.ggml.*``
    values replacing the byte-level BPE one; ``rope_factors``: a ``rope_freqs.weight``;
    ``sizes``: other sizes than :data:`SIZES`; ``rope_dim``: the head dimensions RoPE
    rotates, when not all; ``experts``: a mixture of :data:`EXPERTS`, as a ``qwen3moe`` and a
    ``llama`` one, a mixtral, are; ``sizes`` may change those too); returns each GGUF
    tensor's exact float32 values (none without ``with_exact``: a large file's K-quant and F16
    matrices are then random blocks or bits never decoded). A ``phi3`` has
    Q, K and V in one ``attn_qkv`` and gate and up in one ``ffn_up``, as llama.cpp's; a
    ``gemma3`` has Q/K norms, a norm after each half of a block and a sliding window of 4;
    a ``gemma2`` those norms after each half and small soft caps (0.5 on the attention
    scores, 8 on the logits)."""
    rng = np.random.default_rng(seed)
    s = {**SIZES, **EXPERTS, **(sizes or {})}
    hidden, hd = s["hidden"], s["head_dim"]
    tokens = TOKENS + [f"<x{i}>" for i in range(256 - len(TOKENS))]
    tok_meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["Ġ a", "a b"],
                "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if tokenizer is not None:
        tok_meta = tokenizer
    vocab = max(256, len(tok_meta.get("tokenizer.ggml.tokens", ())))

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    a = arch
    w.add_uint32(f"{a}.block_count", s["n_layer"])
    w.add_uint32(f"{a}.embedding_length", hidden)
    w.add_uint32(f"{a}.feed_forward_length", s["ffn"])
    w.add_uint32(f"{a}.attention.head_count", s["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", s["n_kv"])
    w.add_uint32(f"{a}.attention.key_length", hd)
    w.add_uint32(f"{a}.context_length", 512)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if rope_dim is not None:
        w.add_uint32(f"{a}.rope.dimension_count", rope_dim)
    if experts:
        w.add_uint32(f"{a}.expert_count", s["n_expert"])
        w.add_uint32(f"{a}.expert_used_count", s["n_used"])
        w.add_uint32(f"{a}.expert_feed_forward_length", s["expert_ffn"])
    if arch == "gemma3":
        w.add_uint32(f"{a}.attention.sliding_window", 4)
    if arch == "gemma2":
        w.add_float32(f"{a}.attn_logit_softcapping", 0.5)
        w.add_float32(f"{a}.final_logit_softcapping", 8.0)
    for key, value in tok_meta.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, value)

    exact: dict[str, np.ndarray] = {}

    def put(name: str, type_name: str, values: np.ndarray | tuple[int, ...]) -> None:
        """``values`` may be a shape: random ones drawn only where the type needs them."""
        type_name = (types or {}).get(name, type_name)
        if type_name is None:  # left out of the file
            return
        if isinstance(values, tuple):
            if not with_exact and type_name in BLOCK_TYPES and type_name not in QUANTIZABLE:
                *outer, k = values
                stored = random_blocks(rng, type_name, int(np.prod(outer)), k)
                stored = stored.reshape(*outer, -1)
                w.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=Q[type_name])
                return
            if not with_exact and type_name == "F16":
                w.add_tensor(name, random_halves(rng, values))
                return
            values = rand(*values)
        stored, exact[name] = encode(rng, type_name, values)
        if not with_exact:
            del exact[name]
        if type_name in ("F32", "F16"):
            w.add_tensor(name, stored)
        else:
            w.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=Q[type_name])

    q, kv = s["n_head"] * hd, s["n_kv"] * hd
    put("token_embd.weight", embed, rand(vocab, hidden))
    put("output_norm.weight", "F32", 1 + rand(hidden))
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, np.float32))
    if not tied:
        put("output.weight", linear, rand(vocab, hidden))
    for i in range(s["n_layer"]):
        b = f"blk.{i}"
        put(f"{b}.attn_norm.weight", "F32", 1 + rand(hidden))
        put(f"{b}.ffn_norm.weight", "F32", 1 + rand(hidden))
        matrices = (("attn_q", (q, hidden)), ("attn_k", (kv, hidden)),
                    ("attn_v", (kv, hidden)), ("attn_output", (hidden, q)),
                    ("ffn_gate", (s["ffn"], hidden)), ("ffn_up", (s["ffn"], hidden)),
                    ("ffn_down", (hidden, s["ffn"])))
        if arch == "phi3":
            matrices = (("attn_qkv", (q + 2 * kv, hidden)), ("attn_output", (hidden, q)),
                        ("ffn_up", (2 * s["ffn"], hidden)), ("ffn_down", (hidden, s["ffn"])))
        if experts:
            n, f = s["n_expert"], s["expert_ffn"]
            put(f"{b}.ffn_gate_inp.weight", "F32", rand(n, hidden))
            matrices = (*matrices[:4], ("ffn_gate_exps", (n, f, hidden)),
                        ("ffn_up_exps", (n, f, hidden)), ("ffn_down_exps", (n, hidden, f)))
        for name, shape in matrices:
            put(f"{b}.{name}.weight", linear, shape)
        if arch == "qwen2":
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                put(f"{b}.{name}.bias", "F32", rand(n))
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            put(f"{b}.attn_q_norm.weight", "F32", 1 + rand(hd))
            put(f"{b}.attn_k_norm.weight", "F32", 1 + rand(hd))
        if arch in ("gemma2", "gemma3"):
            put(f"{b}.post_attention_norm.weight", "F32", 1 + rand(hidden))
            put(f"{b}.post_ffw_norm.weight", "F32", 1 + rand(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return exact
