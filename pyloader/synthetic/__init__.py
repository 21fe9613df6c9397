"""Synthetic checkpoints and models for tests and benchmarks: deterministic checkpoints
(:mod:`.checkpoint`), random-weight mlx-lm models (:mod:`.models`), real-shape sharded
directories (:mod:`.shapes`) and their tokenizer (:mod:`.tokenizer`)."""

from .checkpoint import DTYPES, WRITERS, make_checkpoint, synthetic_pair
from .models import make_model, make_moe_model, make_variant

__all__ = ["DTYPES", "WRITERS", "make_checkpoint", "make_model", "make_moe_model",
           "make_variant", "synthetic_pair"]
