"""mlx-lm's generation thread with request checks, cancellation and supervision."""

from __future__ import annotations

import collections
import logging
import threading
import time
from queue import Empty
from typing import Any

from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import (
    GenerationContext,
    ResponseGenerator,
    _make_logits_processors,
    _make_sampler,
)

from ..errors import RequestCancelled, RequestError
from .provider import GenerationFatal, PyloaderModelProvider, checkpoint_changed
from .requests import check_against_model
from .templates import TEMPLATE_ERRORS, TEMPLATE_MAX_CHARS, TEMPLATE_TIMEOUT_S, BoundedTemplates

log = logging.getLogger(__name__)

#: More than MAX_RESTARTS failures within RESTART_WINDOW_S seconds stop the server.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class RequestState:
    """One request's checked ``body`` and cancellation, shared across threads."""

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
    """A request's response queue; aborts prompt processing once cancelled."""

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
                if checkpoint_changed(item):
                    self._generator.model_provider.reopen()
        self._queue.put(item)

    def fail(self, exc: BaseException) -> None:
        """Answer the request with ``exc`` unless it has had its answer."""
        if not self.done:
            self.put(exc)


class GuardedGenerator(ResponseGenerator):
    """mlx-lm's ``ResponseGenerator`` with per-model request checks and cancellation."""

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
        # A failure outside mlx-lm's per-request handlers fails the requests in flight.
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
                    if checkpoint_changed(exc):
                        self.model_provider.reopen()
                    now = time.monotonic()
                    crashes.append(now)
                    while crashes and crashes[0] < now - RESTART_WINDOW_S:
                        crashes.popleft()
                    if len(crashes) > MAX_RESTARTS:
                        raise GenerationFatal(
                            f"generation failed {len(crashes)} times in "
                            f"{RESTART_WINDOW_S:g} s; last: {type(exc).__name__}: "
                            f"{exc}") from exc
                    self.restarts += 1
        except BaseException as exc:
            self.failure = exc
            self._generation_failed = True
            self._fail_active(RuntimeError(f"the server's generation thread died: {exc}"))
            if not isinstance(exc, GenerationFatal):
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
        # mlx-lm's first step with a request, after its model is loaded.
        state = getattr(request, "pyloader_state", None)
        try:
            if state is None:
                raise RequestError("the request did not pass pyloader's checks")
            check_against_model(state.body, self.model_provider.limits())
            bounded = BoundedTemplates(tokenizer, self.template_timeout_s,
                                        self.template_max_chars)
            try:
                result = super()._tokenize(bounded, request, args)
            except TEMPLATE_ERRORS as exc:
                if request.request_type != "chat":
                    raise
                # the template refused the client's messages
                raise RequestError(f"messages: the model's chat template refused them: "
                                   f"{type(exc).__name__}: {exc}") from exc
            prompt = result[0]
            field = "messages" if request.request_type == "chat" else "prompt"
            if len(prompt) == 0:
                raise RequestError(f"{field} tokenizes to no tokens: give at least one "
                                   "token of text")
            context = self.model_provider.context
            if context is not None and len(prompt) >= context:
                raise RequestError(f"{field}: the prompt is {len(prompt)} tokens; the "
                                   f"model's context is {context} tokens")
            # Built here so that a failure fails this request alone, not the batched loop.
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


