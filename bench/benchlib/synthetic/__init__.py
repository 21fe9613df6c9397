"""Synthetic checkpoints and random-weight models for the tests and benchmarks (not part
of the wheel: ``bench/`` is on the path of both)."""

from .checkpoint import DTYPES, WRITERS, make_checkpoint, synthetic_pair
from .models import make_model, make_moe_model, make_variant

__all__ = ["DTYPES", "WRITERS", "make_checkpoint", "make_model", "make_moe_model",
           "make_variant", "synthetic_pair"]
