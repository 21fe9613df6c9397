"""Loading across the ranks of an MLX distributed run.

Pipeline (mlx-lm's ``pipeline``, or the same protocol for llama and qwen3) or tensor sharding
(mlx-lm's ``shard``, traced to read only this rank's slices); each rank reads only its own
tensors. See docs/distributed.md.
"""

from .memory import RankMemory, check_memory, gather_memory, least_need
from .pipeline import StageHook
from .shard import SHARD_MODES, Distribution, shard_model
from .share import Share, check_lockstep
from .split import (
    RankPlan,
    SplitPlan,
    checkpoint_layer_bytes,
    even_split,
    layer_range,
    measure_read_bps,
    plan_split,
    propose_split,
    tensor_layer_bytes,
)
from .stats import rank_stats, slice_stats
from .tensor import ParamSlice, trace_shard

__all__ = [
    "SHARD_MODES",
    "Distribution",
    "ParamSlice",
    "RankMemory",
    "RankPlan",
    "Share",
    "SplitPlan",
    "StageHook",
    "check_lockstep",
    "check_memory",
    "checkpoint_layer_bytes",
    "even_split",
    "gather_memory",
    "layer_range",
    "least_need",
    "measure_read_bps",
    "plan_split",
    "propose_split",
    "rank_stats",
    "shard_model",
    "slice_stats",
    "tensor_layer_bytes",
    "trace_shard",
]
