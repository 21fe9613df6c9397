"""What ``pyloader serve`` is asked to do, without importing mlx-lm.

Two kinds of settings reach the server:

* :class:`ServeOptions`, pyloader's own: how :func:`pyloader.load_model` loads the served
  model (strategy, resident set, prefetch depth, expert caches) and whether each request's
  KV cache is preallocated;
* mlx-lm's server settings (the ``argparse.Namespace`` its ``ModelProvider``,
  ``ResponseGenerator`` and ``APIHandler`` read as ``cli_args``): :data:`SERVER_DEFAULTS`
  holds every one with the default ``mlx_lm.server``'s own parser gives it (mlx-lm
  0.32.2; ``tests/test_serve.py`` compares them with that parser), and
  :func:`server_args` builds the namespace with some of them changed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ..streaming.options import StreamOptions

#: Tokens each request's preallocated KV cache holds when ``--kv-prealloc`` gives none.
DEFAULT_KV_CONTEXT = 4096

#: Every setting ``mlx_lm.server`` reads from its command line, with its default there.
#: ``model`` None means "the model ``pyloader serve`` was given"; ``pipeline`` (distributed
#: serving) is kept False: pyloader serves from one process.
SERVER_DEFAULTS: dict[str, Any] = {
    "model": None,
    "adapter_path": None,
    "host": "127.0.0.1",
    "port": 8080,
    "allowed_origins": ["*"],
    "draft_model": None,
    "num_draft_tokens": 3,
    "trust_remote_code": False,
    "log_level": "INFO",
    "chat_template": "",
    "use_default_chat_template": False,
    "temp": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 512,
    "chat_template_args": {},
    "decode_concurrency": 32,
    "prompt_concurrency": 8,
    "prefill_step_size": 2048,
    "prompt_cache_size": 10,
    "prompt_cache_bytes": None,
    "kv_bits": None,
    "kv_group_size": 64,
    "quantized_kv_start": 5000,
    "pipeline": False,
}


def server_args(**settings: Any) -> argparse.Namespace:
    """mlx-lm's server settings (``cli_args``): :data:`SERVER_DEFAULTS` with ``settings``
    applied.

    Raises:
        TypeError: a name that is not one of mlx-lm's server settings.
    """
    unknown = sorted(set(settings) - set(SERVER_DEFAULTS))
    if unknown:
        raise TypeError(f"not an mlx-lm server setting: {', '.join(unknown)} (known: "
                        f"{', '.join(SERVER_DEFAULTS)})")
    values = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
              for k, v in SERVER_DEFAULTS.items()}
    values.update(settings)
    return argparse.Namespace(**values)


@dataclass
class ServeOptions:
    """How pyloader loads and runs the served model.

    Attributes:
        stream: How :func:`pyloader.load_model` streams the model
            (:class:`pyloader.streaming.StreamOptions`: strategy, resident set, prefetch
            depth, expert caches, ...).
        kv_context: None: mlx-lm's growing KV caches, requests batched as mlx-lm batches
            them. A token count: every request gets pyloader's preallocated KV cache
            (:func:`pyloader.make_kv_cache`) with room for that many tokens, and requests
            are served one at a time (see docs/serving.md for why).
        kernels: ``"auto"`` (pyloader's CPU kernels), ``"mlx"`` (MLX's own ops), or None
            for :func:`pyloader.load_model`'s default (docs/kernels.md).
    """

    stream: StreamOptions = field(default_factory=StreamOptions)
    kv_context: int | None = None
    kernels: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.stream, StreamOptions):
            raise TypeError(f"stream must be a StreamOptions, not {type(self.stream).__name__}")
        if self.kv_context is not None and (not isinstance(self.kv_context, int)
                                            or self.kv_context < 1):
            raise ValueError(f"kv_context must be None or a positive token count, "
                             f"got {self.kv_context!r}")

    def load_kwargs(self) -> dict[str, Any]:
        """The :func:`pyloader.load_model` arguments these options stand for."""
        return {"options": self.stream, "kernels": self.kernels}


__all__ = ["DEFAULT_KV_CONTEXT", "SERVER_DEFAULTS", "ServeOptions", "server_args"]
