"""mlx-lm's OpenAI-compatible server over a model loaded by pyloader. See docs/serving.md."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import get_system_fingerprint

from .._util.procfs import thread_alive
from .generator import GuardedGenerator
from .handler import GuardedHandler
from .provider import PreallocatedPromptCache, PyloaderModelProvider
from .requests import MAX_REQUEST_BYTES, Policy
from .settings import ServeOptions, server_args
from .templates import TEMPLATE_TIMEOUT_S

log = logging.getLogger(__name__)


class ServerFailed(RuntimeError):
    """The generation thread died; :meth:`Server.serve_forever` raises it."""


def _wait_for_thread_exit(native_id: int, timeout_s: float = 10.0,
                          grace_s: float = 0.1) -> None:
    """Wait until OS thread ``native_id`` has exited, or ``grace_s`` where the OS cannot
    say. MLX's thread-local destructor takes the GIL and aborts the process if it runs
    during interpreter shutdown."""
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
    """mlx-lm's HTTP server over a model loaded by pyloader; also a context manager.

    Binds the socket and waits for the model to load (a failed load raises here).

    Args:
        model: The mlx-lm model directory (or Hugging Face repo id) to serve.
        options: How pyloader loads it (:class:`ServeOptions`).
        allow_client_models: Let a request's ``model`` name another model (default: 400).
        max_request_bytes: Largest request body accepted (larger: 413, unread).
        template_timeout_s: Longest a request's chat-template rendering may take.
        **settings: mlx-lm's server settings (:data:`SERVER_DEFAULTS`).

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``allow_client_models`` with ``trust_remote_code``.
    """

    def __init__(self, model, options: ServeOptions | None = None, *,
                 allow_client_models: bool = False,
                 max_request_bytes: int = MAX_REQUEST_BYTES,
                 template_timeout_s: float = TEMPLATE_TIMEOUT_S, **settings: Any):
        self.options = options if options is not None else ServeOptions()
        self.cli_args = server_args(model=str(model), **settings)
        if allow_client_models and self.cli_args.trust_remote_code:
            raise ValueError("allow_client_models with trust_remote_code would let any "
                             "client choose a model directory whose code the server runs; "
                             "use one or the other")
        self.allow_client_models = allow_client_models
        self.max_request_bytes = max_request_bytes
        self.fingerprint = get_system_fingerprint()
        self._in_flight = 0
        self._idle = threading.Condition()
        self.httpd = _bind(self.cli_args.host, self.cli_args.port,
                           functools.partial(GuardedHandler, self))
        self._thread: threading.Thread | None = None
        self.generator = None
        self.failure: ServerFailed | None = None
        self._closing = False
        self._serving = threading.Lock()  # held while serve_forever runs
        try:
            self.provider = PyloaderModelProvider(self.cli_args, self.options)
            self.generator = GuardedGenerator(self.provider, self._prompt_cache(),
                                              template_timeout_s=template_timeout_s)
            while not self.provider.loaded.wait(0.1):
                if not self.generator.generation_available():
                    raise RuntimeError("mlx-lm's generation thread stopped before it loaded "
                                       "the model (see the log above)")
            if self.provider.load_error is not None:
                raise self.provider.load_error
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, args=(self.generator,),
                                          daemon=True, name="pyloader-serve-watchdog")
        self._watchdog.start()

    def _watch(self, generator: GuardedGenerator) -> None:
        """Waits for the generation thread; if it dies, makes :meth:`serve_forever` raise."""
        generator.join()
        if self._closing:
            return
        cause = generator.failure
        self.failure = ServerFailed(f"the generation thread died: "
                                    f"{type(cause).__name__ if cause else 'exit'}: {cause}")
        print(f"pyloader serve: {self.failure}; stopping the server", file=sys.stderr,
              flush=True)
        if self._serving.locked():
            self.httpd.shutdown()

    def _prompt_cache(self) -> LRUPromptCache:
        args = self.cli_args
        max_bytes = args.prompt_cache_bytes if args.prompt_cache_bytes is not None else 1 << 63
        if self.options.kv_context is None:
            return LRUPromptCache(args.prompt_cache_size, max_bytes)
        return PreallocatedPromptCache(self.provider, self.options.kv_context,
                                       args.prompt_cache_size, max_bytes)

    def model_names(self) -> list[str]:
        """The served model's names: its given name and, for a directory, its resolved path."""
        given = self.cli_args.model
        resolved = str(Path(given).resolve()) if Path(given).is_dir() else given
        return list(dict.fromkeys((given, resolved)))

    def policy(self) -> Policy:
        """What a request may choose (:class:`.requests.Policy`)."""
        return Policy(served_names=frozenset(self.model_names()),
                      allow_other_models=self.allow_client_models)

    @contextlib.contextmanager
    def in_flight(self):
        """Count one request in flight while the block runs (:meth:`close` drains them)."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        return tuple(self.httpd.server_address[:2])

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
        """Answer requests until :meth:`close` or Ctrl-C; raises :class:`ServerFailed`."""
        with self._serving:
            if self.failure is None:
                self.httpd.serve_forever()
        if self.failure is not None:
            raise self.failure

    def start(self) -> Server:
        """Answer requests on a background thread; returns the server."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve_quietly, daemon=True,
                                            name="pyloader-serve")
            self._thread.start()
        return self

    def _serve_quietly(self) -> None:
        with contextlib.suppress(ServerFailed):  # said on stderr, kept in .failure
            self.serve_forever()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for requests in flight; True when none is left."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.5))
        return True

    def close(self, drain_s: float = 0.0) -> None:
        """Stop accepting, drain up to ``drain_s`` seconds, stop generation. Idempotent."""
        self._closing = True
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        if drain_s > 0 and not self.drain(drain_s):
            log.warning("%d request(s) still in flight after %.0f s: stopping them",
                        self._in_flight, drain_s)
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


def _bind(host: str, port: int, handler) -> _HTTPServer:
    """The HTTP server on ``host:port``; a failure names the address."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        return _HTTPServer(address, handler, family)
    except socket.gaierror as exc:
        raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {host}:{port}: {exc}") from exc
    except OSError as exc:
        hint = (": another process is listening there; stop it, choose another --port, "
                "or --port 0 for any free port" if exc.errno == errno.EADDRINUSE
                else " (a port below 1024 needs privileges)" if exc.errno == errno.EACCES
                else "")
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}{hint}"
                      ) from exc


