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

and it guards mlx-lm's handler against hostile or careless clients
(:class:`GuardedHandler`, :class:`GuardedGenerator`): every request field checked before
it reaches the model (:mod:`.requests`; 400 with the reason), the rules that depend on
the model checked against the model that runs the request, non-text content refused
before mlx-lm would fetch its URLs, the served model pinned, a request's generation
cancelled when its client disconnects, bodies bounded, and in-flight requests drained
when the server closes.

:class:`Server` binds the socket, starts mlx-lm's ``ResponseGenerator``, waits for the
model (raising the load's own exception when it fails), serves, and shuts everything down.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import errno
import gc
import io
import json
import logging
import select
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Empty
from typing import Any

import mlx.core as mx
from huggingface_hub import scan_cache_dir
from jinja2 import TemplateError
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import (
    APIHandler,
    GenerationContext,
    ModelProvider,
    ResponseGenerator,
    _make_logits_processors,
    _make_sampler,
    get_system_fingerprint,
)

from .._util.procfs import thread_alive
from ..errors import RequestCancelled, RequestError
from ..kv import make_kv_cache
from ..loading import load_model
from ..streaming.options import StreamOptions
from .requests import (
    DEFAULT_MODEL,
    MAX_REQUEST_BYTES,
    Limits,
    Policy,
    check_against_model,
    check_request,
    context_of,
    parse_body,
    vocab_size_of,
)
from .settings import ServeOptions, server_args

log = logging.getLogger(__name__)

#: Longest a request's chat-template rendering may take (seconds) by default.
TEMPLATE_TIMEOUT_S = 10.0
#: Longest text a chat template may render for one request (characters).
TEMPLATE_MAX_CHARS = 16 << 20
#: What a chat template raises on messages it does not accept (its raise_exception).
_TEMPLATE_ERRORS = (TemplateError,)
#: Generation failing more than MAX_RESTARTS times within RESTART_WINDOW_S seconds stops
#: the server (a fault that every request meets is not one a restart cures).
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


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
        vocab_size: The width of the loaded model's logits, or of its draft model's when
            that is narrower (None: unknown, or no model loaded).
        context: The loaded model's context length from its config (None: unknown, or
            no model loaded).
    """

    def __init__(self, cli_args: argparse.Namespace, options: ServeOptions):
        super().__init__(cli_args)
        self.options = options
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.thread_id: int | None = None
        self.vocab_size: int | None = None
        self.context: int | None = None
        self.reopening = False

    def reopen(self) -> None:
        """Load the model again on the next request: one of its files changed on disk
        (the open descriptors would keep failing). A reload that fails then stops the
        generation thread (:class:`_GenerationFatal`), so the server exits instead of
        answering every request with the load's error."""
        self.model_key = None
        self.reopening = True

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        self.thread_id = threading.get_native_id()
        try:
            self._load_with_pyloader(model_path, adapter_path, draft_model_path)
        except BaseException as exc:
            if not self.loaded.is_set():
                self.load_error = exc
            if self.reopening:
                raise _GenerationFatal(f"reopening {model_path} after its files changed "
                                       f"on disk failed: {type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self.loaded.set()
        if self.reopening:
            log.warning("reopened %s: its files changed on disk", model_path)
            self.reopening = False

    def _load_with_pyloader(self, model_path, adapter_path, draft_model_path) -> None:
        if self.is_distributed:
            raise ValueError("pyloader serve runs in one process; for distributed serving "
                             "use mlx_lm.server")
        # Drop the previous model first (mlx-lm does the same): its buffers go back to
        # MLX's pool, which is cleared so that two models never coexist.
        self.reset()
        self.vocab_size = self.context = None  # a failed load leaves no stale limits
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

        vocab_size = vocab_size_of(model, config)
        draft_model = None
        if draft_model_path is not None:
            whole = StreamOptions(strategy=self.options.stream.strategy)
            draft_model, draft_tokenizer = load_model(draft_model_path, options=whole,
                                                      kernels=self.options.kernels)[:2]
            if draft_tokenizer is not None and draft_tokenizer.vocab_size != tokenizer.vocab_size:
                log.warning("the draft model's tokenizer does not match the model's: "
                            "speculative decoding may not work as expected")
            # the request's logits processors run on the draft model's logits too
            draft_vocab = vocab_size_of(draft_model, {})
            vocab_size = (None if vocab_size is None or draft_vocab is None
                          else min(vocab_size, draft_vocab))

        if self.options.kv_context is not None:
            # One cache, dropped at once: a preallocated cache this model cannot have,
            # or one that does not fit in memory, fails the load, not the first request.
            make_kv_cache(model, max_context=self.options.kv_context)
        # Batching merges every request's cache into mlx-lm's growing BatchKVCache, so a
        # preallocated cache would be copied out of its arena at once: with kv_context,
        # requests are served one at a time, each in its own arena.
        batchable = (draft_model is None and self.options.kv_context is None
                     and all(hasattr(c, "merge") for c in make_prompt_cache(model)))

        self.vocab_size = vocab_size
        self.context = context_of(config)
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = load_processor(model, config)
        self.draft_model = draft_model
        self.is_batchable = batchable
        log.info("loaded %s with pyloader (%s)%s", model_path, self.options,
                 "" if batchable else "; requests are served one at a time")

    def limits(self) -> Limits:
        """The loaded model's numbers a request is checked against
        (:func:`.requests.check_against_model`)."""
        return Limits(vocab_size=self.vocab_size, context=self.context)

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


class RequestState:
    """One request's checked body and cancellation, shared by its handler thread, its
    disconnect watcher and mlx-lm's generation thread.

    :meth:`cancel` (the client went away) stops the generation through mlx-lm's own
    ``GenerationContext.stop`` once the context exists, and before that makes the
    generation thread skip the request or abort its prompt processing.

    Attributes:
        body: The request body as :func:`.requests.check_request` passed it; the
            generation thread checks it against the model that runs it.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._ctx: GenerationContext | None = None
        self.rejected = False  # the generation thread refused it (RequestError)
        self.failed = False  # the server failed it (not the client's fault)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled.set()
            if self._ctx is not None:
                self._ctx.stop()

    def attach(self, ctx: GenerationContext) -> None:
        with self._lock:
            self._ctx = ctx
            if self._cancelled.is_set():
                ctx.stop()


class _RequestQueue:
    """A request's response queue as mlx-lm's generation thread sees it: attaches the
    generation context to the :class:`RequestState` when mlx-lm puts it, and on the
    sequential path aborts prompt processing (whose progress reports pass through
    ``put``) once the request is cancelled."""

    def __init__(self, queue, state: RequestState, generator: GuardedGenerator):
        self._queue, self._state, self._generator = queue, state, generator
        self.done = False

    def put(self, item) -> None:
        if isinstance(item, GenerationContext):
            self._state.attach(item)
        elif (isinstance(item, tuple) and self._state.cancelled
              and self._generator.serving_single):
            raise RequestCancelled("the client disconnected during prompt processing")
        elif item is None or isinstance(item, BaseException):
            self.done = True
            self._generator.finished(self)
            if isinstance(item, BaseException) and not isinstance(
                    item, (RequestError, RequestCancelled)):
                self._state.failed = True
                if _checkpoint_changed(item):
                    self._generator.model_provider.reopen()
        self._queue.put(item)

    def fail(self, exc: BaseException) -> None:
        """Answer the request with ``exc`` unless it has had its answer."""
        if not self.done:
            self.put(exc)


def _checkpoint_changed(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a checkpoint file changed on disk under
    the model (the readers' ``OSError(ESTALE)``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ESTALE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _GenerationFatal(BaseException):
    """Stops the generation thread for good (mlx-lm's loop catches ``Exception`` only):
    the server cannot go on serving the model (a reopen after a change on disk failed,
    or generation fails over and over)."""


class ServerFailed(RuntimeError):
    """The server stopped serving: its generation thread died (the message says why).
    :meth:`Server.serve_forever` raises it; ``pyloader serve`` exits non-zero."""


class _RenderAborted(BaseException):
    """Raised asynchronously in a chat-template render that ran past its time bound."""


def _bounded(fn, timeout_s: float, what: str):
    """``fn()`` run on a thread of its own, for at most ``timeout_s`` seconds. Past the
    bound the caller gets :class:`RuntimeError` at once and the render thread is
    interrupted (an asynchronous exception, delivered between two of its Python
    bytecodes: Jinja templates are compiled to Python), so it neither holds the
    generation thread nor runs on."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except _RenderAborted:
            pass
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=run, daemon=True, name="pyloader-template")
    worker.start()
    if not done.wait(timeout_s):
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                   ctypes.py_object(_RenderAborted))
        raise RuntimeError(f"{what} ran past its bound of {timeout_s:g} s and was stopped")
    if "error" in box:
        raise box["error"]
    return box["value"]


class _BoundedTemplates:
    """A tokenizer whose ``apply_chat_template`` renders within a time budget shared by
    every render of one request, and refuses a rendering longer than ``max_chars``
    characters; everything else is the tokenizer's. The text is tokenized as mlx-lm's
    own wrapper tokenizes a rendered template (no special tokens added)."""

    def __init__(self, tokenizer, timeout_s: float, max_chars: int):
        self._tokenizer = tokenizer
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._max_chars = max_chars

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, *args, tokenize=True, **kwargs):
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"the model's chat template ran past its bound of "
                               f"{self._timeout_s:g} s")
        text = _bounded(lambda: self._tokenizer.apply_chat_template(
            *args, tokenize=False, **kwargs), left, "the model's chat template")
        if not isinstance(text, str):
            raise RuntimeError(f"the model's chat template rendered "
                               f"{type(text).__name__}, not text")
        if len(text) > self._max_chars:
            raise RuntimeError(f"the model's chat template rendered {len(text)} "
                               f"characters (at most {self._max_chars})")
        if not tokenize:
            return text
        return self._tokenizer.encode(text, add_special_tokens=False)


class GuardedGenerator(ResponseGenerator):
    """mlx-lm's ``ResponseGenerator`` with four additions:

    * a request is checked against the numbers of the model that runs it
      (:func:`.requests.check_against_model`: ``logit_bias`` ids, ``top_k``,
      ``max_tokens``) on the generation thread, once that model is loaded and before
      the request reaches it; refused: :class:`RequestError`, 400. The handler cannot do
      this: with client-chosen models the request may name a model other than the one
      loaded when it arrives, and mlx-lm switches models on this thread;
    * a prompt longer than the model's context is refused (:class:`RequestError`, 400)
      right after tokenization, before any of it is processed;
    * a request whose client has gone is skipped when the generation thread reaches it,
      its prompt processing aborted (sequential path) or its sequence removed from the
      batch (mlx-lm's ``GenerationContext.stop``);
    * a handler waiting for a response notices its request's cancellation.
    """

    def __init__(self, provider: PyloaderModelProvider, prompt_cache: LRUPromptCache,
                 template_timeout_s: float = TEMPLATE_TIMEOUT_S,
                 template_max_chars: int = TEMPLATE_MAX_CHARS):
        self.serving_single = False
        self.waiting = threading.local()  # .state: the handler thread's RequestState
        self.template_timeout_s = template_timeout_s
        self.template_max_chars = template_max_chars
        self.failure: BaseException | None = None  # why the generation thread died
        self.restarts = 0
        self._active: set[_RequestQueue] = set()
        self._active_lock = threading.Lock()
        super().__init__(provider, prompt_cache)

    def finished(self, rqueue: _RequestQueue) -> None:
        with self._active_lock:
            self._active.discard(rqueue)

    def _fail_active(self, exc: BaseException) -> None:
        with self._active_lock:
            active, self._active = list(self._active), set()
        for rqueue in active:
            rqueue.fail(exc)

    def _run_generate(self):
        # mlx-lm's loop lets an exception raised outside its per-request handlers
        # (inside a batch step, or while a request joins the batch) end the thread;
        # the process then stays up answering every request with an error. Here such
        # an exception fails the requests in flight (their batch is gone with the
        # loop's state) and the loop starts again; repeated failures, or a reopen that
        # fails, end the thread and Server stops the process.
        crashes: collections.deque[float] = collections.deque()
        try:
            while not self._stop:
                try:
                    self._generate()
                    return
                except Exception as exc:
                    log.exception("generation failed; the requests in flight are failed "
                                  "and generation goes on")
                    self._fail_active(RuntimeError(f"generation failed: "
                                                   f"{type(exc).__name__}: {exc}"))
                    if _checkpoint_changed(exc):
                        self.model_provider.reopen()
                    now = time.monotonic()
                    crashes.append(now)
                    while crashes and crashes[0] < now - RESTART_WINDOW_S:
                        crashes.popleft()
                    if len(crashes) > MAX_RESTARTS:
                        raise _GenerationFatal(
                            f"generation failed {len(crashes)} times in "
                            f"{RESTART_WINDOW_S:g} s; last: {type(exc).__name__}: "
                            f"{exc}") from exc
                    self.restarts += 1
        except BaseException as exc:
            self.failure = exc
            self._generation_failed = True
            self._fail_active(RuntimeError(f"the server's generation thread died: {exc}"))
            if not isinstance(exc, _GenerationFatal):
                log.exception("the generation thread died")

    def stop_and_join(self):
        self._stop = True
        self._generation_thread.join()

    def _next_request(self, timeout=None):
        item = super()._next_request(timeout)
        if item is None:
            return None
        rqueue, request, args = item
        state = getattr(request, "pyloader_state", None)
        if state is None:
            return item
        if state.cancelled:  # its client left while it waited: skip it
            rqueue.put(RequestCancelled("the client disconnected before generation"))
            return None
        tracked = _RequestQueue(rqueue, state, self)
        with self._active_lock:
            self._active.add(tracked)
        return tracked, request, args

    def _serve_single(self, request, stream):
        self.serving_single = True
        try:
            super()._serve_single(request, stream)
        finally:
            self.serving_single = False

    def _tokenize(self, tokenizer, request, args):
        # mlx-lm's first step with a request on both paths (sequential and batched), run
        # after the model that serves it is loaded (a batch holds one model: a request
        # for another waits until the batch is drained and that model loaded), and
        # before its sampler and logits processors are made.
        state = getattr(request, "pyloader_state", None)
        try:
            if state is None:
                raise RequestError("the request did not pass pyloader's checks")
            check_against_model(state.body, self.model_provider.limits())
            bounded = _BoundedTemplates(tokenizer, self.template_timeout_s,
                                        self.template_max_chars)
            try:
                result = super()._tokenize(bounded, request, args)
            except _TEMPLATE_ERRORS as exc:
                if request.request_type != "chat":
                    raise
                # the model's template refused the client's messages (roles out of
                # order, a tool call it cannot render...)
                raise RequestError(f"messages: the model's chat template refused them: "
                                   f"{type(exc).__name__}: {exc}") from exc
            prompt = result[0]
            if len(prompt) == 0:
                field = "messages" if request.request_type == "chat" else "prompt"
                raise RequestError(f"{field} tokenizes to no tokens: give at least one "
                                   "token of text")
            context = self.model_provider.context
            if context is not None and len(prompt) >= context:
                field = "messages" if request.request_type == "chat" else "prompt"
                raise RequestError(f"{field}: the prompt is {len(prompt)} tokens; the "
                                   f"model's context is {context} tokens")
            # What mlx-lm builds next from the request runs where an exception ends
            # the batched loop: build it here, where it fails this request alone (the
            # state machine is cached, and the sampler and processors are cheap).
            self._make_state_machine(self.model_provider.model_key, tokenizer,
                                     args.stop_words)
            _make_sampler(args, tokenizer)
            _make_logits_processors(args)
        except RequestError:
            if state is not None:
                state.rejected = True
            raise
        return result

    def _await_response(self, response_queue):
        state = getattr(self.waiting, "state", None)
        while True:
            try:
                return response_queue.get(timeout=0.2)
            except Empty:
                if state is not None and state.cancelled:
                    raise RequestCancelled("the client disconnected") from None
                if not self.generation_available():
                    raise RuntimeError(f"the server's generation thread died: "
                                       f"{self.failure}") from None


class _DisconnectWatcher:
    """Polls a request's socket while it is being answered and cancels the request when
    the client closes the connection (end of file, or a reset). A client that sends more
    bytes before the answer (pipelining) is not watched further."""

    def __init__(self, sock: socket.socket, state: RequestState, interval_s: float = 0.1):
        self.sock, self.state, self.interval_s = sock, state, interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="pyloader-serve-watch")

    def _run(self) -> None:
        poller = select.poll()  # not select.select: descriptors above 1023 are fine
        try:
            poller.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        except (OSError, ValueError):
            return  # the socket is already closed: the handler sees that itself
        timeout_ms = int(self.interval_s * 1000)
        while not self._done.is_set():
            try:
                if not poller.poll(timeout_ms):
                    continue
                if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return  # more bytes from the client: not a disconnect
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass  # reset
            if not self._done.is_set():
                self.state.cancel()
            return

    def __enter__(self) -> _DisconnectWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


class GuardedHandler(APIHandler):
    """mlx-lm's ``APIHandler`` behind pyloader's checks (the server's ``guard`` supplies
    the policy and counts requests in flight):

    * a body longer than the limit gets 413 without being read; a body that is not a
      JSON object, or nests deeper than :data:`.requests.MAX_DEPTH`, gets 400;
    * every field passed on to the model is checked (:func:`.requests.check_request`):
      400 with the reason, nothing queued; a message content part that is not text
      (``image_url``...) is refused there, before mlx-lm's chat handler would fetch it;
      what depends on the model is checked on the generation thread
      (:class:`GuardedGenerator`);
    * a request's ``model`` must name the served model unless the operator allowed
      others;
    * the client's disconnection cancels the request's generation;
    * ``GET /v1/models`` always answers a JSON list.
    """

    def __init__(self, guard: Server, *args, **kwargs):
        self.guard = guard
        self.state: RequestState | None = None
        self.checked_body: dict[str, Any] | None = None
        self.model_name = DEFAULT_MODEL
        super().__init__(guard.generator, *args, system_fingerprint=guard.fingerprint,
                         **kwargs)

    def _refuse(self, status: int, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        if status == 413:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def send_response(self, code, message=None) -> None:
        # mlx-lm answers an error raised before the first token with 404: a request the
        # generation thread refused (a prompt longer than the context) is the client's
        # mistake (400); one the server failed is the server's (500), or 503 once the
        # generation thread is gone.
        if code == 404 and self.state is not None:
            code = (400 if self.state.rejected
                    else 503 if not self.response_generator.generation_available()
                    else 500)
        super().send_response(code, message)

    def do_POST(self) -> None:
        with self.guard.in_flight():
            self._guarded_post()

    def _guarded_post(self) -> None:
        # a keep-alive connection's previous request is done
        self.state = self.checked_body = None
        self._headers_ended = False
        if self.path not in ("/v1/completions", "/v1/chat/completions", "/chat/completions"):
            return super().do_POST()  # mlx-lm's 404
        length = self.headers.get("Content-Length")
        if length is None:
            return super().do_POST()  # mlx-lm's 411
        try:
            length = int(length)
            if length < 0:
                raise ValueError
        except ValueError:
            return self._refuse(400, "Invalid Content-Length header")
        limit = self.guard.max_request_bytes
        if length > limit:
            return self._refuse(413, f"the request body is {length} bytes; this server "
                                     f"accepts at most {limit}")
        raw = self.rfile.read(length)
        try:
            body = parse_body(raw)
            self.model_name = body.get("model", DEFAULT_MODEL)
            check_request(body, self.path, self.guard.policy())
        except RequestError as exc:
            return self._refuse(400, str(exc))
        self.checked_body = body
        # mlx-lm parses the (possibly rewritten) body again from here
        data = json.dumps(body).encode()
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(data))
        self.rfile = io.BytesIO(data)
        super().do_POST()

    def generate_response(self, *args, **kwargs) -> dict:
        # mlx-lm echoes the model name it loads by; the client gets the name it sent
        return {**super().generate_response(*args, **kwargs), "model": self.model_name}

    def completion_usage_response(self, *args, **kwargs) -> dict:
        return {**super().completion_usage_response(*args, **kwargs),
                "model": self.model_name}

    def _track(self, request):
        self.state = RequestState(self.checked_body)
        request.pyloader_state = self.state
        return request

    def handle_text_completions(self):
        return self._track(super().handle_text_completions())

    def handle_chat_completions(self):
        return self._track(super().handle_chat_completions())

    def handle_completion(self, request, stop_words) -> None:
        generator = self.response_generator
        generator.waiting.state = self.state
        try:
            with _DisconnectWatcher(self.connection, self.state):
                super().handle_completion(request, stop_words)
        except (RequestCancelled, ConnectionError) as exc:
            self.state.cancel()
            self.close_connection = True
            log.info("request from %s cancelled: %s", self.address_string(), exc)
        except Exception as exc:
            # failed after its generation started (a batch step, a changed file): the
            # client gets the error, the connection is closed, the server goes on
            self.state.failed = True
            self.close_connection = True
            message = f"{type(exc).__name__}: {exc}"
            if not self._headers_ended:
                self._headers_buffer = []
                code = 503 if not generator.generation_available() else 500
                self._refuse(code, message)
            else:
                with contextlib.suppress(OSError):
                    self.wfile.write(f"data: {json.dumps({'error': message})}\n\n".encode())
                    self.wfile.flush()
        finally:
            generator.waiting.state = None

    def end_headers(self) -> None:
        self._headers_ended = True
        super().end_headers()

    def handle_models_request(self) -> None:
        models = [{"id": name, "object": "model", "created": self.created}
                  for name in self.guard.model_names()]
        if self.guard.allow_client_models:
            models += [{"id": repo, "object": "model", "created": self.created}
                       for repo in _cached_models()]
        parts = self.path.split("?")[0].split("/")
        if len(parts) > 3 and parts[3]:
            wanted = "/".join(parts[3:])
            models = [m for m in models if m["id"] == wanted]
        data = json.dumps({"object": "list", "data": models}).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _cached_models() -> list[str]:
    """The repo ids of the mlx-lm models (config, index and tokenizer config) in the
    Hugging Face cache; none when there is no cache."""
    try:
        info = scan_cache_dir()
    except Exception as exc:  # no cache directory (CacheNotFound), unreadable cache
        log.debug("no Hugging Face cache to list: %s", exc)
        return []
    need = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
    out = []
    for repo in info.repos:
        if repo.repo_type != "model" or "main" not in repo.refs:
            continue
        if need <= {f.file_path.name for f in repo.refs["main"].files}:
            out.append(repo.repo_id)
    return out


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
        allow_client_models: Let a request's ``model`` (``adapters``, ``draft_model``)
            name another model, which the server then loads in place of this one
            (mlx-lm's behaviour). Default False: the model is pinned and such requests
            get 400. Refused together with ``trust_remote_code`` (a client would choose
            which code runs).
        max_request_bytes: Largest request body accepted (larger: 413, unread).
        template_timeout_s: Longest a request's chat-template rendering may take; past
            it that request fails (500) and the next one is served.
        **settings: mlx-lm's server settings (:data:`SERVER_DEFAULTS`), e.g.
            ``max_tokens=``, ``temp=``, ``decode_concurrency=``.

    Raises:
        OSError: the address cannot be bound (the message names it; ``EADDRINUSE``: the
            port is taken).
        ValueError: ``allow_client_models`` with ``trust_remote_code``.
    """

    def __init__(self, model, options: ServeOptions | None = None, *,
                 host: str = "127.0.0.1", port: int = 8080,
                 allow_client_models: bool = False,
                 max_request_bytes: int = MAX_REQUEST_BYTES,
                 template_timeout_s: float = TEMPLATE_TIMEOUT_S, **settings: Any):
        self.options = options if options is not None else ServeOptions()
        self.cli_args = server_args(model=str(model), host=host, port=port, **settings)
        if allow_client_models and self.cli_args.trust_remote_code:
            raise ValueError("allow_client_models with trust_remote_code would let any "
                             "client choose a model directory whose code the server runs; "
                             "use one or the other")
        self.allow_client_models = allow_client_models
        self.max_request_bytes = max_request_bytes
        self.fingerprint = get_system_fingerprint()
        self._in_flight = 0
        self._idle = threading.Condition()
        self.httpd = _bind(host, port, self._handler)
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
        """Waits for the generation thread; if it ends while the server is not closing,
        says why on stderr and stops :meth:`serve_forever`, which raises
        :class:`ServerFailed` (a supervisor restarts a process that exits; nobody
        restarts one that stays up failing every request)."""
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

    def _handler(self, *args, **kwargs):
        return GuardedHandler(self, *args, **kwargs)

    def model_names(self) -> list[str]:
        """The names ``GET /v1/models`` lists for the served model and a request's
        ``model`` may give: the name it was started with and, for a directory, its
        resolved path."""
        given = self.cli_args.model
        names = [given]
        path = Path(given)
        if path.is_dir():
            resolved = str(path.resolve())
            if resolved != given:
                names.append(resolved)
        return names

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
        """Answer requests until :meth:`close` (from another thread) or Ctrl-C.

        Raises:
            ServerFailed: the generation thread died (the message says why): the server
                cannot answer any more requests.
        """
        with self._serving:
            if self.failure is None:
                self.httpd.serve_forever()
        if self.failure is not None:
            raise self.failure

    def start(self) -> Server:
        """Answer requests on a background thread; returns the server (:attr:`failure`
        is set if its generation thread dies)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve_quietly, daemon=True,
                                            name="pyloader-serve")
            self._thread.start()
        return self

    def _serve_quietly(self) -> None:
        with contextlib.suppress(ServerFailed):  # said on stderr, kept in .failure
            self.serve_forever()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the requests in flight to be answered;
        True when none is left. New connections are not accepted once
        :meth:`serve_forever` has returned."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.5))
        return True

    def close(self, drain_s: float = 0.0) -> None:
        """Stop accepting connections, give the requests in flight up to ``drain_s``
        seconds to finish, stop mlx-lm's generation thread (which drops the model) and
        close the socket. Safe to call more than once."""
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
    """The HTTP server listening on ``host:port``; a failure names the address and, for a
    port in use, what to do."""
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


__all__ = ["GuardedGenerator", "GuardedHandler", "PreallocatedPromptCache",
           "PyloaderModelProvider", "RequestState", "Server", "ServerFailed"]
