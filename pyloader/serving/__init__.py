"""``pyloader serve`` (no mlx-lm import here; see :mod:`.server`, docs/serving.md)."""

from .settings import DEFAULT_KV_CONTEXT, SERVER_DEFAULTS, ServeOptions, server_args

__all__ = ["DEFAULT_KV_CONTEXT", "SERVER_DEFAULTS", "ServeOptions", "server_args"]
