"""mlx-lm's OpenAI-compatible server with the model loaded (or streamed) by pyloader.

Everything that speaks HTTP and generates is mlx-lm's (``mlx_lm.server``): ``APIHandler``
(``/v1/completions``, ``/v1/chat/completions``, streaming, ``/health``, ``/v1/models``),
``ResponseGenerator`` (one generation thread, continuous batching with ``BatchGenerator``
when the model's caches can be merged, the prompt cache) and ``LRUPromptCache``. pyloader
supplies two things:

* :class:`PyloaderModelProvider`, mlx-lm's ``ModelProvider`` with its one loading step
  (``_load``) done by :func:`pyloader.load_model` with the :class:`ServeOptions`; it runs
  on mlx-lm's generation thread, as mlx-lm's own load does;
* with ``ServeOptions(kv_context=N)``, :class:`PreallocatedPromptCache`: mlx-lm's prompt
  cache store, except that a request with nothing cached gets pyloader's preallocated KV
  cache (:func:`pyloader.make_kv_cache`) instead of none (the server then makes mlx-lm's).

:class:`Server` binds the socket, starts mlx-lm's ``ResponseGenerator``, waits for the
model (raising the load's own exception when it fails), serves, and shuts everything down.
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, get_system_fingerprint

from .._util.procfs import thread_alive
from ..kv import make_kv_cache
from ..loading import load_model
from .settings import ServeOptions, server_args

log = logging.getLogger(__name__)


class PyloaderModelProvider(ModelProvider):
    """mlx-lm's model provider, loading through :func:`pyloader.load_model`.

    mlx-lm calls ``load`` (which maps ``"default_model"`` to ``cli_args.model`` and
    reloads only when the requested model, adapter or draft model changes) from its
    generation thread; this class replaces the step that builds the model. The draft
    model of speculative decoding is loaded by pyloader too, fully resident.

    Attributes:
        options: The :class:`ServeOptions` every load uses.
        loaded: Set when the first load has finished, successfully or not.
        load_error: The exception the first load raised, if any.
        thread_id: The OS thread id of the thread that loads (mlx-lm's generation
            thread), once it has loaded.
    """

    def __init__(self, cli_args: argparse.Namespace, options: ServeOptions):
        super().__init__(cli_args)
        self.options = options
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.thread_id: int | None = None

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        self.thread_id = threading.get_native_id()
        try:
            self._load_with_pyloader(model_path, adapter_path, draft_model_path)
        except BaseException as exc:
            if not self.loaded.is_set():
                self.load_error = exc
            raise
        finally:
            self.loaded.set()

    def _load_with_pyloader(self, model_path, adapter_path, draft_model_path) -> None:
        if self.is_distributed:
            raise ValueError("pyloader serve runs in one process; for distributed serving "
                             "use mlx_lm.server")
        # Drop the previous model first (mlx-lm does the same): its buffers go back to
        # MLX's pool, which is cleared so that two models never coexist.
        self.reset()
        gc.collect()
        mx.clear_cache()

        kwargs = self._load_kwargs(adapter_path)
        model, tokenizer, config = load_model(model_path, **kwargs)
        if tokenizer is None:
            raise FileNotFoundError(
                f"{model_path} has no tokenizer (tokenizer.json / tokenizer_config.json): "
                "serving needs one; copy the tokenizer files of the original model into it")
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template

        draft_model = None
        if draft_model_path is not None:
            draft_model, draft_tokenizer = load_model(draft_model_path,
                                                      strategy=self.options.strategy)[:2]
            if draft_tokenizer is not None and draft_tokenizer.vocab_size != tokenizer.vocab_size:
                log.warning("the draft model's tokenizer does not match the model's: "
                            "speculative decoding may not work as expected")

        if self.options.kv_context is not None:
            # One cache, dropped at once: a preallocated cache this model cannot have,
            # or one that does not fit in memory, fails the load, not the first request.
            make_kv_cache(model, max_context=self.options.kv_context)
        # Batching merges every request's cache into mlx-lm's growing BatchKVCache, so a
        # preallocated cache would be copied out of its arena at once: with kv_context,
        # requests are served one at a time, each in its own arena.
        batchable = (draft_model is None and self.options.kv_context is None
                     and all(hasattr(c, "merge") for c in make_prompt_cache(model)))

        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = load_processor(model, config)
        self.draft_model = draft_model
        self.is_batchable = batchable
        log.info("loaded %s with pyloader (%s)%s", model_path, self.options,
                 "" if batchable else "; requests are served one at a time")

    def _load_kwargs(self, adapter_path) -> dict[str, Any]:
        """``load_model``'s arguments: the options, plus what mlx-lm's own load is given
        (the adapter, the tokenizer config, trust_remote_code), and the config back."""
        return {**self.options.load_kwargs(), "adapter_path": adapter_path,
                "tokenizer_config": self._tokenizer_config,
                "trust_remote_code": self.cli_args.trust_remote_code, "return_config": True}


class PreallocatedPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache store, handing out pyloader's preallocated KV caches.

    mlx-lm asks the store for the cache nearest to a request's prompt and makes the
    model's own (growing) caches when there is none; the server gives a provider no other
    say in which caches a request gets. Here a miss returns a fresh
    :func:`pyloader.make_kv_cache` of ``max_context`` tokens (plus the draft model's
    caches, as mlx-lm adds them) and the prompt uncached. Hits are mlx-lm's deep copies
    of stored caches, which for pyloader's caches are new arenas of the same size.
    """

    def __init__(self, provider: ModelProvider, max_context: int, max_size: int = 10,
                 max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.provider = provider
        self.max_context = max_context

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is None:
            cache = make_kv_cache(self.provider.model, max_context=self.max_context)
            if self.provider.draft_model is not None:
                cache += make_prompt_cache(self.provider.draft_model)
        return cache, rest


def _wait_for_thread_exit(native_id: int, timeout_s: float = 10.0,
                          grace_s: float = 0.1) -> None:
    """Wait until the OS thread ``native_id`` has exited (Linux: it leaves /proc/self/task),
    or ``grace_s`` seconds where the OS cannot say (no /proc/self/task: macOS, or
    ``PYLOADER_NO_PROC``).

    ``Thread.join`` returns before the OS thread runs its thread-local destructors, and
    MLX's Python module has one that takes the GIL: run during interpreter shutdown (a
    process that exits right after :meth:`Server.close`), it aborts the process with
    "terminate called without an active exception". Sleeping here lets it take the GIL.
    """
    if thread_alive(native_id) is None:
        time.sleep(grace_s)
        return
    deadline = time.monotonic() + timeout_s
    while thread_alive(native_id) and time.monotonic() < deadline:
        time.sleep(0.002)


class _HTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` for an address of either family (IPv4 or IPv6)."""

    def __init__(self, address, handler, family):
        self.address_family = family
        super().__init__(address, handler)


class Server:
    """mlx-lm's HTTP server over a model loaded by pyloader.

    ``Server(...)`` binds the socket (``port=0``: any free port), starts mlx-lm's
    generation thread, which loads the model, and waits for the load: a failed load
    raises its own exception here. :meth:`serve_forever` (or :meth:`start`, in a
    thread) then answers requests until :meth:`close`. Also a context manager.

    Args:
        model: The mlx-lm model directory (or Hugging Face repo id) to serve.
        options: How pyloader loads it (:class:`ServeOptions`).
        host, port: Where to listen.
        **settings: mlx-lm's server settings (:data:`SERVER_DEFAULTS`), e.g.
            ``max_tokens=``, ``temp=``, ``decode_concurrency=``.
    """

    def __init__(self, model, options: ServeOptions | None = None, *,
                 host: str = "127.0.0.1", port: int = 8080, **settings: Any):
        self.options = options if options is not None else ServeOptions()
        self.cli_args = server_args(model=str(model), host=host, port=port, **settings)
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self.fingerprint = get_system_fingerprint()
        self.httpd = _HTTPServer(address, self._handler, family)
        self._thread: threading.Thread | None = None
        self.generator = None
        try:
            self.provider = PyloaderModelProvider(self.cli_args, self.options)
            self.generator = ResponseGenerator(self.provider, self._prompt_cache())
            while not self.provider.loaded.wait(0.1):
                if not self.generator.generation_available():
                    raise RuntimeError("mlx-lm's generation thread stopped before it loaded "
                                       "the model (see the log above)")
            if self.provider.load_error is not None:
                raise self.provider.load_error
        except BaseException:
            self.close()
            raise

    def _prompt_cache(self) -> LRUPromptCache:
        args = self.cli_args
        max_bytes = args.prompt_cache_bytes if args.prompt_cache_bytes is not None else 1 << 63
        if self.options.kv_context is None:
            return LRUPromptCache(args.prompt_cache_size, max_bytes)
        return PreallocatedPromptCache(self.provider, self.options.kv_context,
                                       args.prompt_cache_size, max_bytes)

    def _handler(self, *args, **kwargs):
        return APIHandler(self.generator, *args, system_fingerprint=self.fingerprint,
                          **kwargs)

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        host, port = self.httpd.server_address[:2]
        return host, port

    @property
    def url(self) -> str:
        """``http://host:port`` of the server."""
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def model(self):
        """The served model (None before the first load and after :meth:`close`)."""
        return self.provider.model

    def serve_forever(self) -> None:
        """Answer requests until :meth:`close` (from another thread) or Ctrl-C."""
        self.httpd.serve_forever()

    def start(self) -> Server:
        """Answer requests on a background thread; returns the server."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                            name="pyloader-serve")
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop answering, stop mlx-lm's generation thread (which drops the model) and
        close the socket. Safe to call more than once."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()
        if self.generator is not None:
            self.generator.stop_and_join()
            self.generator = None
            if self.provider.thread_id is not None:
                _wait_for_thread_exit(self.provider.thread_id)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["PreallocatedPromptCache", "PyloaderModelProvider", "Server"]
