"""mlx-lm's HTTP request handler behind pyloader's request checks."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import select
import socket
import threading
from typing import Any, Protocol

from huggingface_hub import scan_cache_dir
from mlx_lm.server import APIHandler

from ..errors import RequestCancelled, RequestError
from .generator import GuardedGenerator, RequestState
from .requests import DEFAULT_MODEL, Policy, check_request, parse_body

log = logging.getLogger(__name__)


class Guard(Protocol):
    """What :class:`GuardedHandler` needs from its server (:class:`.server.Server`)."""

    generator: GuardedGenerator
    fingerprint: str
    max_request_bytes: int
    allow_client_models: bool

    def in_flight(self) -> contextlib.AbstractContextManager: ...

    def policy(self) -> Policy: ...

    def model_names(self) -> list[str]: ...


class _DisconnectWatcher:
    """Cancels a request when its client disconnects while it is answered."""

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
    """mlx-lm's ``APIHandler`` behind pyloader's checks (413/400, model pinned)."""

    def __init__(self, guard: Guard, *args, **kwargs):
        self.guard = guard
        self.state: RequestState | None = None
        self.checked_body: dict[str, Any] | None = None
        self.model_name = DEFAULT_MODEL
        super().__init__(guard.generator, *args, system_fingerprint=guard.fingerprint,
                         **kwargs)

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        if status == 413:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def send_response(self, code, message=None) -> None:
        # mlx-lm answers an early error with 404: map it to 400, 500 or 503.
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
            return self._reply(400, {"error": "Invalid Content-Length header"})
        limit = self.guard.max_request_bytes
        if length > limit:
            return self._reply(413, {"error": f"the request body is {length} bytes; this "
                                              f"server accepts at most {limit}"})
        try:
            body = parse_body(self.rfile.read(length))
            self.model_name = body.get("model", DEFAULT_MODEL)
            check_request(body, self.path, self.guard.policy())
        except RequestError as exc:
            return self._reply(400, {"error": str(exc)})
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
            # failed after generation started: report, close the connection, go on
            self.state.failed = True
            self.close_connection = True
            message = f"{type(exc).__name__}: {exc}"
            if not self._headers_ended:
                self._headers_buffer = []
                code = 503 if not generator.generation_available() else 500
                self._reply(code, {"error": message})
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
        names = [*self.guard.model_names(),
                 *(_cached_models() if self.guard.allow_client_models else ())]
        models = [{"id": name, "object": "model", "created": self.created} for name in names]
        parts = self.path.split("?")[0].split("/")
        if len(parts) > 3 and parts[3]:
            models = [m for m in models if m["id"] == "/".join(parts[3:])]
        self._reply(200, {"object": "list", "data": models})


def _cached_models() -> list[str]:
    """Repo ids of the mlx-lm models in the Hugging Face cache (none without a cache)."""
    try:
        info = scan_cache_dir()
    except Exception as exc:  # no cache directory (CacheNotFound), unreadable cache
        log.debug("no Hugging Face cache to list: %s", exc)
        return []
    need = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
    return [repo.repo_id for repo in info.repos
            if repo.repo_type == "model" and "main" in repo.refs
            and need <= {f.file_path.name for f in repo.refs["main"].files}]


