"""Tiny mixture-of-experts checkpoints (real mlx-lm architectures, fixed seeds).

The configs are registered in ``models.ARCHS`` so ``models.make_model_dir`` builds
and saves them like every other test model. Each one has hidden size 64, 2-3
decoder layers, 8-16 experts, top-k 2-4 and a 256-token vocabulary.

Two variants of each: float32 (``mx.gather_mm``, mlx-lm's unquantized
``SwitchLinear``, only supports float32 on the CPU, so a bf16 unquantized MoE
model cannot run here at all) and 4-bit (built in bf16, then quantized by
``mlx_lm.utils.quantize_model`` with group size 32; ``gather_qmm`` works with
bf16 scales).

Parameters mlx-lm initializes to zeros (expert biases, gpt_oss's attention
sinks, deepseek_v3's router weight and score-correction bias) get random
values (``fill_zeros``), so a wrong expert/slot mapping of them shows up.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from models import ARCHS, make_model_dir

_COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

MOE_ARCHS: dict[str, dict] = {
    # Qwen3-MoE: SwitchGLU, softmax top-k with normalized scores.
    "qwen3_moe": {
        **_COMMON, "model_type": "qwen3_moe", "num_hidden_layers": 2,
        "intermediate_size": 128, "head_dim": 16, "num_experts": 16,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": 32, "norm_topk_prob": True,
    },
    # Qwen3.5-MoE: hybrid (gated-delta linear attention, full attention every 2nd
    # layer), experts plus a gated shared expert; the text model under text_config.
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": {
            **_COMMON, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 2,
            "intermediate_size": 128, "head_dim": 16, "linear_num_value_heads": 4,
            "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "norm_topk_prob": True,
            # Tied embeddings would make this tiny model echo its input token.
            "tie_word_embeddings": False,
        },
    },
    # Mixtral: block_sparse_moe.switch_mlp, 8 experts, top-2.
    "mixtral": {
        **_COMMON, "model_type": "mixtral", "num_hidden_layers": 2,
        "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    # gpt-oss: SwitchGLU with biases and its own clamped SwiGLU, attention sinks,
    # sliding-window layers alternating with full attention (window < prompt).
    "gpt_oss": {
        **_COMMON, "model_type": "gpt_oss", "num_hidden_layers": 2,
        "intermediate_size": 32, "head_dim": 16, "num_local_experts": 8,
        "num_experts_per_tok": 4, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # DeepSeek-V3: MLA attention, first layer dense, then sigmoid group-limited
    # routing (4 groups of 4 experts, 2 groups kept, top-4) plus a shared expert.
    "deepseek_v3": {
        **_COMMON, "model_type": "deepseek_v3", "num_hidden_layers": 3,
        "num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32,
        "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True,
    },
    # OLMoE: routes flattened tokens ([N, D] with [N, k] indices), expert biases on.
    "olmoe": {
        **_COMMON, "model_type": "olmoe", "num_hidden_layers": 2,
        "intermediate_size": 32, "head_dim": 16, "num_experts": 16,
        "num_experts_per_tok": 4, "norm_topk_prob": False, "mlp_bias": True,
    },
}
ARCHS.update(MOE_ARCHS)

#: (arch, bits): bits None is float32, 4 is 4-bit quantized from bf16.
VARIANTS = [(arch, bits) for arch in MOE_ARCHS for bits in (None, 4)]


def variant_id(arch: str, bits) -> str:
    return f"{arch}-{'q4' if bits else 'f32'}"


def make_moe_dir(path: Path, arch: str, bits: int | None = None, seed: int = 0,
                 mode: str = "affine") -> Path:
    """A tiny `arch` MoE checkpoint saved like mlx-lm saves it: float32, or 4-bit
    (group size 32, MLX's quantization `mode`) quantized from bf16."""
    dtype = mx.bfloat16 if bits else mx.float32
    return make_model_dir(path, arch, dtype=dtype, bits=bits, seed=seed, fill_zeros=True,
                          mode=mode)
