"""What ``pyloader serve`` is asked to do, without importing mlx-lm."""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field
from typing import Any

from ..streaming.options import StreamOptions

#: Tokens each request's preallocated KV cache holds when ``--kv-prealloc`` gives none.
DEFAULT_KV_CONTEXT = 4096

#: Every setting ``mlx_lm.server`` reads, with its default.
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
    """mlx-lm's server settings: :data:`SERVER_DEFAULTS` with ``settings`` applied.

    Raises:
        TypeError: a name that is not one of mlx-lm's server settings.
    """
    unknown = sorted(set(settings) - set(SERVER_DEFAULTS))
    if unknown:
        raise TypeError(f"not an mlx-lm server setting: {', '.join(unknown)} (known: "
                        f"{', '.join(SERVER_DEFAULTS)})")
    return argparse.Namespace(**{**copy.deepcopy(SERVER_DEFAULTS), **settings})


@dataclass
class ServeOptions:
    """How pyloader loads and runs the served model.

    Attributes:
        stream: :class:`pyloader.streaming.StreamOptions` for :func:`pyloader.load_model`.
        kv_context: None: mlx-lm's growing caches. A token count: a preallocated cache each.
        kernels: ``"auto"``, ``"mlx"`` or None (:func:`pyloader.load_model`'s default).
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


