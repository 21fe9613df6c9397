"""A preallocated KV cache that speaks mlx-lm's cache protocol.

* :mod:`.plan`: the model's working dtype (:func:`working_dtype`: a quantized model's
  comes from its ``scales``, never its packed ``uint32`` weights) and what
  :func:`make_kv_cache` would allocate (:func:`plan_kv_cache`);
* :mod:`.caches`: the arena caches (:class:`KVCache`, :class:`QuantizedKVCache`),
  :func:`make_kv_cache` and :func:`load_prompt_cache`.

Needs mlx-lm (``pip install "pyloader-mlx[compare]"``). Design: docs/kv-cache.md.
"""

from ..errors import KVCacheWarning
from .caches import KVCache, QuantizedKVCache, load_prompt_cache, make_kv_cache
from .plan import KVCachePlan, KVLayerPlan, plan_kv_cache, working_dtype

__all__ = [
    "KVCache",
    "KVCachePlan",
    "KVCacheWarning",
    "KVLayerPlan",
    "QuantizedKVCache",
    "load_prompt_cache",
    "make_kv_cache",
    "plan_kv_cache",
    "working_dtype",
]
