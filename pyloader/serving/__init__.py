"""``pyloader serve``'s package; importing it does not import mlx-lm (the server is
:mod:`pyloader.serving.server`). See docs/serving.md."""

from .settings import DEFAULT_KV_CONTEXT, SERVER_DEFAULTS, ServeOptions, server_args

__all__ = ["DEFAULT_KV_CONTEXT", "SERVER_DEFAULTS", "ServeOptions", "server_args"]
