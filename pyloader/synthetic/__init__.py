"""Synthetic checkpoints and models: what ``pyloader synthetic`` writes and what
``pyloader compare --synthetic`` and ``--load-only`` measure.

* :mod:`.checkpoint`: deterministic llama-shaped ``.safetensors`` files in the two layouts
  a loader meets (aligned, and misaligned as ``mx.save_safetensors`` writes them);
* :mod:`.models`: random-weight mlx-lm models of a chosen size (llama, qwen3, qwen3_moe);
* :mod:`.shapes`: sharded model directories of real models' shapes;
* :mod:`.tokenizer`: the small byte-level tokenizer those models ship with.
"""

from .checkpoint import DTYPES, WRITERS, make_checkpoint, synthetic_pair
from .models import make_model, make_moe_model, make_variant

__all__ = ["DTYPES", "WRITERS", "make_checkpoint", "make_model", "make_moe_model",
           "make_variant", "synthetic_pair"]
