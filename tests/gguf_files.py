"""Small GGUF files for the conversion tests: a tiny random llama as llama.cpp writes one."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from pyloader.gguf import permute_qk_rows


def tiny_llama_gguf(path: Path, hf_qk: dict, *, tensors: dict | None = None,
                    **metadata_overrides) -> Path:
    """Random llama weights written as llama.cpp would: Q/K rows permuted per head
    (``hf_qk`` receives each block's Hugging Face-order Q and K). ``tensors`` and the
    keyword arguments replace tensors and metadata values (None drops one)."""
    rng = np.random.default_rng(3)
    hidden, n_head, n_kv, head_dim, ffn, n_layer = 64, 4, 2, 16, 96, 2
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġa", "ab"]
    vocab = len(tokens)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * 0.1)

    arrays = {"token_embd.weight": rand(vocab, hidden), "output_norm.weight": mx.ones((hidden,)),
              "output.weight": rand(vocab, hidden)}
    for i in range(n_layer):
        q, k = rand(n_head * head_dim, hidden), rand(n_kv * head_dim, hidden)
        hf_qk[i] = (q, k)
        arrays.update({
            f"blk.{i}.attn_norm.weight": mx.ones((hidden,)),
            f"blk.{i}.ffn_norm.weight": mx.ones((hidden,)),
            f"blk.{i}.attn_q.weight": permute_qk_rows(q, n_head),
            f"blk.{i}.attn_k.weight": permute_qk_rows(k, n_kv),
            f"blk.{i}.attn_v.weight": rand(n_kv * head_dim, hidden),
            f"blk.{i}.attn_output.weight": rand(hidden, n_head * head_dim),
            f"blk.{i}.ffn_gate.weight": rand(ffn, hidden),
            f"blk.{i}.ffn_up.weight": rand(ffn, hidden),
            f"blk.{i}.ffn_down.weight": rand(hidden, ffn),
        })

    def u32(v):
        return mx.array(v, dtype=mx.uint32)

    metadata = {
        "general.architecture": "llama",
        "llama.block_count": u32(n_layer),
        "llama.embedding_length": u32(hidden),
        "llama.feed_forward_length": u32(ffn),
        "llama.attention.head_count": u32(n_head),
        "llama.attention.head_count_kv": u32(n_kv),
        "llama.context_length": u32(256),
        "llama.rope.freq_base": mx.array(10000.0),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-6),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ a", "a b"],
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * (vocab - 3), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
    }
    for overrides, into in ((metadata_overrides, metadata), (tensors or {}, arrays)):
        for k, v in overrides.items():
            if v is None:
                into.pop(k, None)
            else:
                into[k] = v
    mx.save_gguf(str(path), arrays, metadata)
    return path
