"""``pyloader serve``: mlx-lm's OpenAI-compatible HTTP server over models loaded by pyloader.

* :mod:`.settings`: what the server is asked to do, without mlx-lm: :class:`ServeOptions`
  (how pyloader loads the model, whether each request's KV cache is preallocated) and
  mlx-lm's own server settings with their defaults (:data:`SERVER_DEFAULTS`,
  :func:`server_args`);
* (these need mlx-lm) :mod:`.server`: :class:`~.server.Server`, which binds the socket and
  runs, serves and stops the parts below; :mod:`.provider`: the model, loaded through
  :func:`pyloader.load_model` (:class:`~.provider.PyloaderModelProvider`);
  :mod:`.generator`: mlx-lm's ``ResponseGenerator`` with each request checked against the
  model and the generation thread supervised; :mod:`.templates`: chat templates rendered
  within a time and size bound; :mod:`.handler`: mlx-lm's ``APIHandler`` behind the
  request checks of :mod:`.requests`.

Importing this package does not import mlx-lm; import :mod:`pyloader.serving.server` for
the server. Design and limits: docs/serving.md.
"""

from .settings import DEFAULT_KV_CONTEXT, SERVER_DEFAULTS, ServeOptions, server_args

__all__ = ["DEFAULT_KV_CONTEXT", "SERVER_DEFAULTS", "ServeOptions", "server_args"]
