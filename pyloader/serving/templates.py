"""Chat templates rendered within a per-request time budget and size limit."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

from jinja2 import TemplateError

#: Longest a request's chat-template rendering may take (seconds) by default.
TEMPLATE_TIMEOUT_S = 10.0
#: Longest text a chat template may render for one request (characters).
TEMPLATE_MAX_CHARS = 16 << 20
#: What a chat template raises on messages it does not accept (its raise_exception).
TEMPLATE_ERRORS = (TemplateError,)


class _RenderAborted(BaseException):
    """Raised asynchronously in a chat-template render that ran past its time bound."""


def _bounded(fn, timeout_s: float, what: str):
    """``fn()`` on its own thread, interrupted past ``timeout_s`` (RuntimeError)."""
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


class BoundedTemplates:
    """A tokenizer whose chat-template rendering is bounded in time and ``max_chars``."""

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


