"""Request checks of ``pyloader serve`` (RequestError, HTTP 400). See docs/serving.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError

#: Deepest nesting of arrays/objects a request body may have (OpenAI's schemas need 5).
MAX_DEPTH = 64
#: Default largest request body, in bytes (``pyloader serve --max-request-bytes``).
MAX_REQUEST_BYTES = 16 << 20
#: The model name a request may always give (mlx-lm's name for "the served model").
DEFAULT_MODEL = "default_model"
#: mlx-lm's bound on ``top_logprobs``.
MAX_TOP_LOGPROBS = 11
#: Largest ``num_draft_tokens`` (speculative decoding drafts this many per step).
MAX_DRAFT_TOKENS = 64
#: ``mx.random.seed`` takes an unsigned 64-bit integer.
SEED_LIMIT = 1 << 64
#: Largest magnitude of a numeric sampling field given as an integer (a float's exact range).
NUMBER_LIMIT = 2 ** 53
#: ``chat_template_kwargs`` keys a request may pass, with each value's type.
TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool, "thinking": bool,
                                    "reasoning_effort": str}
#: Longest string value of an allowed ``chat_template_kwargs`` key.
MAX_TEMPLATE_KWARG_CHARS = 64
#: The penalties' context sizes (tokens looked back at), at most the model's context.
_CONTEXT_SIZES = ("repetition_context_size", "presence_context_size",
                  "frequency_context_size")


@dataclass(frozen=True)
class Policy:
    """What the operator lets a request choose (:func:`check_request`): the names
    ``model`` may give for the served model, and whether it may name others."""

    served_names: frozenset[str] = field(default_factory=frozenset)
    allow_other_models: bool = False


@dataclass(frozen=True)
class Limits:
    """The model's ``vocab_size`` (None refuses ``logit_bias``) and ``context``."""

    vocab_size: int | None = None
    context: int | None = None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (RequestError: not UTF-8 JSON, nested deeper
    than :data:`MAX_DEPTH`, or not an object)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except RecursionError:  # json's scanner recurses once per level
        raise RequestError(f"the request body nests arrays/objects too deep (at most "
                           f"{MAX_DEPTH})") from None
    except ValueError as exc:
        raise RequestError(f"Invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("Request should be a JSON dictionary")
    depth = _max_depth(body)
    if depth > MAX_DEPTH:
        raise RequestError(f"the request body nests arrays/objects {depth} deep "
                           f"(at most {MAX_DEPTH})")
    _check_unicode(body)
    return body


def _check_unicode(body: dict) -> None:
    """Refuse lone surrogates from JSON escapes, naming the field."""
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in body.items()]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str) and _bad_unicode(v):
            raise RequestError(f"{where} holds a lone UTF-16 surrogate (an unpaired "
                               "\\ud800-\\udfff escape): not valid Unicode")
        if isinstance(v, dict):
            for k, child in v.items():
                if not isinstance(k, str) or _bad_unicode(k):
                    raise RequestError(f"{where} has a key that is not valid Unicode")
                stack.append((f"{where}.{k}", child))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(v))
    for k in body:
        if _bad_unicode(k):
            raise RequestError("a field name of the request is not valid Unicode")


def _bad_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _max_depth(value: Any) -> int:
    """The deepest list/dict nesting of a parsed JSON list or object (iterative)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in (v.values() if isinstance(v, dict) else v)
                     if isinstance(child, (list, dict)))
    return deepest


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _int(body: dict, name: str, lo: int, hi: int | None = None, *,
         also: tuple = ()) -> None:
    if name not in body or body[name] is None or body[name] in also:
        return
    v = body[name]
    if not _is_int(v):
        raise RequestError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rule = f"at least {lo}" if hi is None else f"in {lo}..{hi}"
        raise RequestError(f"{name} must be {rule}, got {v}")


def _number(body: dict, name: str, lo: float | None = None,
            hi: float | None = None) -> None:
    if name not in body or body[name] is None:
        return
    v = body[name]
    if _is_int(v) and abs(v) > NUMBER_LIMIT:
        raise RequestError(f"{name} must be a finite number of at most {NUMBER_LIMIT:g} "
                           f"in magnitude, got {v}")
    if not _is_number(v):
        raise RequestError(f"{name} must be a finite number, got {v!r}")
    # MLX casts a Python int to int32; a large one raises mid-sampling, so use a float.
    body[name] = float(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rule = (f"in [{lo}, {hi}]" if lo is not None and hi is not None
                else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise RequestError(f"{name} must be {rule}, got {v}")


def _typed(body: dict, name: str, types: tuple, what: str) -> None:
    if name in body and body[name] is not None and not isinstance(body[name], types):
        raise RequestError(f"{name} must be {what}, got {type(body[name]).__name__}")


def check_request(body: dict[str, Any], path: str, policy: Policy) -> None:
    """Check a request's model-independent fields for endpoint ``path`` (its
    ``prompt``, or ``messages``); pins ``body["model"]`` to DEFAULT_MODEL, changing nothing
    else. RequestError names the first field that breaks a rule."""
    _check_model(body, policy)
    if path == "/v1/completions":
        if "prompt" not in body:
            raise RequestError("Request did not contain a prompt")
        if not isinstance(body["prompt"], str):
            raise RequestError("prompt must be a string")
        if not body["prompt"]:
            raise RequestError("prompt is empty: give at least one character")
    else:
        _check_messages(body.get("messages"))

    for name in ("max_tokens", "max_completion_tokens"):
        _int(body, name, 1)
    _number(body, "temperature", 0)
    _number(body, "top_p", 0, 1)
    _int(body, "top_k", 0)
    _number(body, "min_p", 0, 1)
    _number(body, "xtc_probability", 0, 1)
    _number(body, "xtc_threshold", 0, 1)
    _number(body, "repetition_penalty", 0)
    _number(body, "presence_penalty")
    _number(body, "frequency_penalty")
    for name in _CONTEXT_SIZES:
        _int(body, name, 0)
    _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, also=(-1,))
    _int(body, "num_draft_tokens", 0, MAX_DRAFT_TOKENS)
    _int(body, "seed", 0, SEED_LIMIT - 1)
    _typed(body, "stream", (bool,), "true or false")
    _typed(body, "logprobs", (bool,), "true or false")
    _typed(body, "stream_options", (dict,), "an object")
    if isinstance(body.get("stream_options"), dict):
        # mlx-lm indexes ["include_usage"] after the stream has started
        include = body["stream_options"].setdefault("include_usage", False)
        if not isinstance(include, bool):
            raise RequestError("stream_options.include_usage must be true or false")
    _check_template_kwargs(body.get("chat_template_kwargs"))
    _typed(body, "role_mapping", (dict,), "an object")
    if isinstance(body.get("role_mapping"), dict) and not all(
            isinstance(v, str) for v in body["role_mapping"].values()):
        raise RequestError("role_mapping must map names to strings")
    _typed(body, "tools", (list,), "a list")
    if isinstance(body.get("tools"), list) and not all(
            isinstance(t, dict) for t in body["tools"]):
        raise RequestError("tools must be a list of objects")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop must be a string or a list of strings")
    _check_logit_bias(body.get("logit_bias"))


def check_against_model(body: dict[str, Any], limits: Limits) -> None:
    """Check the rules that depend on the model's vocabulary and context (RequestError
    names the first field that breaks one)."""
    ctx = limits.context
    for name in ("max_tokens", "max_completion_tokens"):
        _int(body, name, 1, ctx)
    for name in _CONTEXT_SIZES:
        _int(body, name, 0, ctx)
    _int(body, "top_k", 0, limits.vocab_size)
    bias = body.get("logit_bias")
    if not bias:
        return
    vocab_size = limits.vocab_size
    if vocab_size is None:
        raise RequestError("logit_bias is not supported for this model: its config gives "
                           "no vocab_size to check token ids against")
    for key in bias:
        token = int(key)
        if token >= vocab_size:
            raise RequestError(f"logit_bias: token id {token} is outside the vocabulary "
                               f"of the model serving this request (0..{vocab_size - 1})")


def _check_messages(messages: Any) -> None:
    """``messages``: non-empty, string roles, text parts only (no ``image_url``)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string, a list of text "
                               f"parts or null, got {type(content).__name__}")
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise RequestError(f"{where} must be an object "
                                   '{"type": "text", "text": ...}')
            kind = part.get("type")
            if kind != "text":
                raise RequestError(
                    f"{where}.type is {kind!r}: this server accepts only \"text\" content "
                    "parts (it serves text generation; images, audio and files are refused "
                    "and their URLs are never fetched)")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.text must be a string")


def _check_template_kwargs(kwargs: Any) -> None:
    """``chat_template_kwargs``: only :data:`TEMPLATE_KWARGS` keys, each of its type."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got "
                           f"{type(kwargs).__name__}")
    for key, value in kwargs.items():
        want = TEMPLATE_KWARGS.get(key)
        if want is None:
            raise RequestError(
                f"chat_template_kwargs.{key} is not accepted: the chat template and its "
                f"tokenization belong to the model (accepted keys: "
                f"{', '.join(TEMPLATE_KWARGS)})")
        if not isinstance(value, want) or (want is str
                                           and len(value) > MAX_TEMPLATE_KWARG_CHARS):
            what = ("true or false" if want is bool
                    else f"a string of at most {MAX_TEMPLATE_KWARG_CHARS} characters")
            raise RequestError(f"chat_template_kwargs.{key} must be {what}, got {value!r:.80}")


def _check_logit_bias(bias: Any) -> None:
    """``logit_bias``: non-negative integer token ids to finite numbers."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object of token id to bias")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias: {key!r} is not a token id") from None
        if token < 0:
            raise RequestError(f"logit_bias: token id {token} is outside the vocabulary "
                               "(negative)")
        if not _is_number(value) or (_is_int(value) and abs(value) > NUMBER_LIMIT):
            raise RequestError(f"logit_bias: the bias of token {token} must be a finite "
                               f"number of at most {NUMBER_LIMIT:g} in magnitude, got "
                               f"{value!r:.40}")
        bias[key] = float(value)


def _check_model(body: dict, policy: Policy) -> None:
    model = body.get("model", DEFAULT_MODEL)
    if not isinstance(model, str):
        raise RequestError("model must be a string")
    if policy.allow_other_models:
        return
    if model != DEFAULT_MODEL and model not in policy.served_names:
        # The same answer whatever ``model`` names: nothing about the host leaks.
        raise RequestError(
            f"model {model!r} is not served here: this server serves one model "
            f"({', '.join(sorted(policy.served_names)) or DEFAULT_MODEL}); omit \"model\" "
            "or give that name")
    for name in ("adapters", "draft_model"):
        if body.pop(name, None) not in (None, DEFAULT_MODEL):
            raise RequestError(f"{name} cannot be chosen by a request on this server "
                               "(the operator sets it)")
    body["model"] = DEFAULT_MODEL


def context_of(config: dict[str, Any]) -> int | None:
    """The context length a model config declares, or None."""
    keys = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
            "n_ctx")
    values = (cfg.get(key) for cfg in (config, config.get("text_config") or {})
              if isinstance(cfg, dict) for key in keys)
    return next((v for v in values if _is_int(v) and v > 0), None)


def vocab_size_of(model: Any, config: dict[str, Any]) -> int | None:
    """The width of the model's logits, from ``model.args`` or the config, or None."""
    text = config.get("text_config")
    candidates = (getattr(getattr(model, "args", None), "vocab_size", None),
                  config.get("vocab_size"),
                  text.get("vocab_size") if isinstance(text, dict) else None)
    return next((v for v in candidates if _is_int(v) and v > 0), None)


