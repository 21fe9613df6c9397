"""``pyloader serve``: mlx-lm's OpenAI-compatible HTTP server over models loaded by pyloader.

Importing this package does not import mlx-lm; the server is
:mod:`pyloader.serving.server`. See docs/serving.md.
"""

from .settings import DEFAULT_KV_CONTEXT, SERVER_DEFAULTS, ServeOptions, server_args

__all__ = ["DEFAULT_KV_CONTEXT", "SERVER_DEFAULTS", "ServeOptions", "server_args"]
