"""A request-body fuzzer against the real ``pyloader serve`` server (loopback HTTP, the
default model): every field of ``/v1/completions`` and ``/v1/chat/completions`` set to
valid-looking and hostile values (wrong types, empty, huge, negative, NaN, nested,
unicode), on mlx-lm's batched path and on its sequential path (a seeded request is
served alone). After every case an ordinary request must still get the right answer.

A case passes when the server answers it with 200 (a complete, well-formed answer) or
with 400 whose message names the field; anything else (a 404 "generation thread died",
a 5xx, a dropped connection, a wrong or missing answer to the next ordinary request)
fails it. The default run draws a sample of the cases (seeded, the seed printed);
``pytest -m fuzz_long`` runs all of them.
"""

from __future__ import annotations

import http.client
import json
import random
from urllib.parse import urlsplit

import pytest

from pyloader.default_model import default_model_path
from pyloader.serving.server import Server

from helpers import fuzz_seed

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Capital of France?"}]

#: Values every field is tried with.
VALUES = [
    None, True, False, 0, 1, -1, 3, 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63), 10 ** 30,
    0.5, -0.5, 1e308, -1e308, float("nan"), float("inf"), float("-inf"),
    "", "x", "0", "-1", " ", "\u0000", "\U0001f642" * 3, "\ud800", "a" * 100_000,
    [], [1], [""], ["x"], [None], [[[[]]]], ["a"] * 1000,
    {}, {"a": 1}, {"0": 1}, {"role": "user", "content": "x"}, {"text": "x", "type": "text"},
]

COMMON = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "xtc_probability", "xtc_threshold", "repetition_penalty",
          "repetition_context_size", "presence_penalty", "presence_context_size",
          "frequency_penalty", "frequency_context_size", "logit_bias", "logprobs",
          "top_logprobs", "seed", "stop", "stream", "stream_options", "num_draft_tokens",
          "adapters", "draft_model", "n", "user", "echo", "suffix"]
COMPLETIONS = COMMON + ["prompt"]
CHAT_FIELDS = COMMON + ["messages", "tools", "role_mapping", "chat_template_kwargs",
                        "tool_choice", "response_format", "messages[0].content",
                        "messages[0].role", "messages[0].name",
                        "messages[0].content[0].text", "stream_options.include_usage",
                        "logit_bias.5", "chat_template_kwargs.enable_thinking"]


def cases() -> list[tuple[str, str, str, object]]:
    """(path name, endpoint, field, value) for every field of both endpoints, on both
    generation paths."""
    out = []
    for mode in ("batched", "sequential"):
        for endpoint, fields in (("/v1/completions", COMPLETIONS),
                                 ("/v1/chat/completions", CHAT_FIELDS)):
            for field in fields:
                for value in VALUES:
                    out.append((mode, endpoint, field, value))
    return out


def body_of(mode: str, endpoint: str, field: str, value) -> dict:
    body = ({"prompt": PROMPT} if endpoint == "/v1/completions"
            else {"messages": json.loads(json.dumps(CHAT))})
    body |= {"max_tokens": 2, "temperature": 0}
    if mode == "sequential":
        body["seed"] = 0  # mlx-lm serves a seeded request alone, outside the batch
    if field == "messages[0].content[0].text":
        body["messages"][0]["content"] = [{"type": "text", "text": value}]
    elif field.startswith("messages[0]."):
        body["messages"][0][field.split(".")[1]] = value
    elif field == "stream_options.include_usage":
        body |= {"stream": True, "stream_options": {"include_usage": value}}
    elif field == "logit_bias.5":
        body["logit_bias"] = {"5": value}
    elif field == "chat_template_kwargs.enable_thinking":
        body["chat_template_kwargs"] = {"enable_thinking": value}
    else:
        body[field] = value
    return body


def send(url: str, endpoint: str, body: dict) -> tuple[int | None, bytes]:
    """(status, body) of one POST; status None when the connection broke."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", endpoint, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException) as exc:
        return None, repr(exc).encode()
    finally:
        conn.close()


def well_formed(endpoint: str, body: dict, data: bytes) -> bool:
    """A 200's body is a complete answer: JSON, or an SSE stream ending in [DONE]."""
    try:
        if body.get("stream") is True:
            text = data.decode()
            return text.rstrip().endswith("data: [DONE]")
        r = json.loads(data)
        choice = r["choices"][0]
        return isinstance(choice["message" if "chat" in endpoint else "text"],
                          dict if "chat" in endpoint else str)
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def field_named(field: str, error: str) -> bool:
    """A 400 names the field (its top-level name, or a part of a nested one)."""
    parts = field.replace("[0]", "").split(".")
    return any(p in error for p in parts if p not in ("0", "5")) or (
        field == "logit_bias.5" and "logit_bias" in error)


def run(server: Server, selected, ordinary: str) -> list[str]:
    """The failures of the selected cases, each followed by an ordinary request."""
    failures = []
    for mode, endpoint, field, value in selected:
        body = body_of(mode, endpoint, field, value)
        what = f"{mode} {endpoint} {field}={str(value)[:40]!r}"
        status, data = send(server.url, endpoint, body)
        if status == 200:
            if not well_formed(endpoint, body, data):
                failures.append(f"{what}: 200 with a broken answer {data[:200]!r}")
        elif status == 400:
            try:
                error = json.loads(data)["error"]
            except (ValueError, KeyError):
                error = ""
            if not field_named(field, error):
                failures.append(f"{what}: 400 without naming the field: {data[:200]!r}")
        else:
            failures.append(f"{what}: {status} {data[:200]!r}")
        check, got = send(server.url, "/v1/completions",
                          {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
        text = json.loads(got)["choices"][0]["text"] if check == 200 else None
        if text != ordinary:
            failures.append(f"{what}: then an ordinary request got {check} {got[:200]!r}")
            if len(failures) > 20 or check is None:
                break
    return failures


@pytest.fixture(scope="module")
def server():
    with Server(str(default_model_path()), port=0).start() as srv:
        yield srv


@pytest.fixture(scope="module")
def ordinary(server) -> str:
    status, data = send(server.url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert status == 200, data
    return json.loads(data)["choices"][0]["text"]


#: Cases in the default run (of about 4,300; about half a minute), drawn with the seed
#: ``PYLOADER_FUZZ_SEED``, else a new one each run (printed, to replay a failure).
SAMPLE = 60


def test_fuzzed_request_bodies_fail_alone(server, ordinary):
    seed = fuzz_seed()
    print(f"PYLOADER_FUZZ_SEED={seed}")
    selected = random.Random(seed).sample(cases(), SAMPLE)
    failures = run(server, selected, ordinary)
    assert not failures, f"PYLOADER_FUZZ_SEED={seed}\n" + "\n".join(failures)


@pytest.mark.fuzz_long
def test_fuzzed_request_bodies_fail_alone_every_case(server, ordinary):
    failures = run(server, cases(), ordinary)
    assert not failures, "\n".join(failures)
