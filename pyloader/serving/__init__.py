"""``pyloader serve``: mlx-lm's OpenAI-compatible HTTP server over models loaded by pyloader.

* :mod:`.settings`: what the server is asked to do, without mlx-lm: :class:`ServeOptions`
  (how pyloader loads the model, whether each request's KV cache is preallocated) and
  mlx-lm's own server settings with their defaults (:data:`SERVER_DEFAULTS`,
  :func:`server_args`);
* :mod:`.server` (needs mlx-lm): :class:`~.server.Server`, which runs mlx-lm's
  ``APIHandler`` and ``ResponseGenerator`` with a model provider that loads through
  :func:`pyloader.load_model` (:class:`~.server.PyloaderModelProvider`).

Importing this package does not import mlx-lm; import :mod:`pyloader.serving.server` for
the server. Design and limits: docs/serving.md.
"""

from .settings import DEFAULT_KV_CONTEXT, SERVER_DEFAULTS, ServeOptions, server_args

__all__ = ["DEFAULT_KV_CONTEXT", "SERVER_DEFAULTS", "ServeOptions", "server_args"]
