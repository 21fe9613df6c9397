"""A preallocated KV cache that speaks mlx-lm's cache protocol: :mod:`.plan`
(working dtype, :func:`plan_kv_cache`) and :mod:`.caches` (:func:`make_kv_cache`,
:func:`load_prompt_cache`). Needs mlx-lm. See docs/kv-cache.md."""

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
