"""Hooking a module's ``__call__`` without changing what it is.

Streaming, pipeline stages and the pressure monitor each swap an instance's class
for a subclass whose ``__call__`` wraps the original, so ``isinstance`` checks,
attributes and mlx-lm's own code paths stay as they were.
"""

from __future__ import annotations

from typing import Callable, Optional


def call_hook_class(cls: type, prefix: str, call: Callable, base_attr: str,
                    cache: Optional[dict[type, type]] = None) -> type:
    """A subclass of ``cls`` named ``prefix + cls.__name__`` whose ``__call__`` is
    ``call``; ``cls`` stays reachable as the class attribute ``base_attr`` (each hook
    uses its own name, so hooks can stack). With ``cache``, one subclass per class."""
    sub = cache.get(cls) if cache is not None else None
    if sub is None:
        sub = type(f"{prefix}{cls.__name__}", (cls,),
                   {"__call__": call, base_attr: cls,
                    "__doc__": cls.__doc__, "__module__": cls.__module__})
        if cache is not None:
            cache[cls] = sub
    return sub
