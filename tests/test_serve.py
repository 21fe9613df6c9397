"""``pyloader serve``: mlx-lm's HTTP server over models loaded by pyloader, checked over
real HTTP on loopback against ``mlx_lm.generate`` on the same model loaded by mlx-lm.

The model is the default model (SmolLM2-135M-Instruct, converted once into the cache, as
tests/test_gguf.py and tests/test_cli.py use it): the tiny test checkpoints have no
tokenizer, and a server needs one.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import mlx.core as mx
import mlx_lm
import pytest
from models import make_model_dir

import pyloader
from pyloader.cli import build_parser
from pyloader.cli import main as cli_main
from pyloader.default_model import default_model_path
from pyloader.kv import plan_kv_cache
from pyloader.serving import SERVER_DEFAULTS, ServeOptions, server_args
from pyloader.serving import provider as serving_server
from pyloader.serving.server import Server

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"}]
TOKENS = 6        # resident model
FEW = 3           # streamed model: every token reads all 30 layers


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(default_model_path())


@pytest.fixture(scope="module")
def reference(model_path):
    """The same model loaded by plain mlx-lm: what the server's answers must equal."""
    model, tok = mlx_lm.load(model_path)
    return model, tok, {}


def expected(reference, prompt, max_tokens: int) -> str:
    """mlx-lm's greedy continuation of a text prompt or of a chat (list of messages),
    computed once per prompt and length."""
    model, tok, done = reference
    key = (json.dumps(prompt), max_tokens)
    if key not in done:
        if isinstance(prompt, list):
            prompt = tok.apply_chat_template(prompt, add_generation_prompt=True)
        done[key] = mlx_lm.generate(model, tok, prompt, max_tokens=max_tokens)
    return done[key]


@pytest.fixture(scope="module")
def resident(model_path):
    with Server(model_path, port=0).start() as srv:
        yield srv


@pytest.fixture(scope="module")
def streamed(model_path):
    options = ServeOptions(pyloader.StreamOptions(resident=0, prefetch=2))
    with Server(model_path, options, port=0).start() as srv:
        yield srv


def call(url: str, method: str, path: str, body=None, headers=None):
    """(status, headers, body bytes) of one request; ``body`` is JSON-encoded unless it is
    already bytes."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def post(url: str, path: str, body: dict) -> dict:
    status, _, data = call(url, "POST", path, body)
    assert status == 200, data
    return json.loads(data)


def answer(url: str, prompt, max_tokens: int) -> str:
    """The server's greedy answer: /v1/completions for text, /v1/chat/completions for a
    list of messages."""
    if isinstance(prompt, list):
        r = post(url, "/v1/chat/completions",
                 {"messages": prompt, "max_tokens": max_tokens, "temperature": 0})
        return r["choices"][0]["message"]["content"] or ""
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                      "temperature": 0})
    return r["choices"][0]["text"]


def sse(data: bytes) -> list[dict]:
    """The JSON events of a server-sent-event stream that ends with ``data: [DONE]``
    (comment lines, mlx-lm's keepalives, skipped)."""
    events = []
    text = data.decode()
    assert text.endswith("\n\n"), text[-100:]
    for block in text.split("\n\n")[:-1]:
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if not lines:
            continue
        assert all(line.startswith("data: ") for line in lines), block
        events.append("\n".join(line[len("data: "):] for line in lines))
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# ---------------------------------------------------------------------------- answers


@pytest.mark.parametrize("prompt", [PROMPT, MESSAGES], ids=["completions", "chat"])
def test_greedy_answers_equal_mlx_lm(resident, reference, prompt):
    want = expected(reference, prompt, TOKENS)
    assert want.strip()  # the comparison means something
    assert answer(resident.url, prompt, TOKENS) == want


@pytest.mark.parametrize("prompt", [PROMPT, MESSAGES], ids=["completions", "chat"])
def test_streamed_model_answers_equal_mlx_lm(streamed, reference, prompt):
    """Every layer streamed from disk (resident=0), as mlx-lm's server drives it."""
    before = pyloader.stats(streamed.model)
    assert before["streamed_units"] == 30
    assert answer(streamed.url, prompt, FEW) == expected(reference, prompt, FEW)
    after = pyloader.stats(streamed.model)
    assert after["bytes_read"] >= before["bytes_read"] + FEW * after["streamed_bytes_per_pass"]


def test_usage_and_finish_reason(resident, reference):
    r = post(resident.url, "/v1/completions",
             {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    tok = reference[1]
    assert r["object"] == "text_completion"
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] == len(tok.encode(PROMPT))
    assert r["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("prompt", [PROMPT, MESSAGES], ids=["completions", "chat"])
def test_streaming_response_is_sse_of_the_same_text(resident, reference, prompt):
    chat = isinstance(prompt, list)
    body = ({"messages": prompt} if chat else {"prompt": prompt}) | {
        "max_tokens": TOKENS, "temperature": 0, "stream": True}
    status, headers, data = call(resident.url, "POST",
                                 "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status == 200
    assert headers["Content-type"].startswith("text/event-stream")
    events = sse(data)
    assert len(events) >= 2  # pieces as they come, then the finish
    if chat:
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    else:
        text = "".join(e["choices"][0]["text"] for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert text == expected(reference, prompt, TOKENS)


def test_concurrent_requests_are_all_served(streamed, reference):
    """Three clients at once on the streamed model (mlx-lm batches them): each gets its
    own prompt's answer."""
    prompts = ["One, two,", "The sky is", MESSAGES]
    start = threading.Barrier(len(prompts))

    def client(prompt):
        start.wait()
        return answer(streamed.url, prompt, FEW)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(client, prompts))
    assert got == [expected(reference, p, FEW) for p in prompts]


# ---------------------------------------------------------------------------- bad requests


MALFORMED = [
    ("bad JSON", "/v1/completions", b"{not json", 400),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400),
    ("no messages", "/v1/chat/completions", {"max_tokens": 3}, 400),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("max_tokens not an int", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("unknown path", "/v1/nothing", {"prompt": "x"}, 404),
]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(resident, reference):
    for what, path, body, status in MALFORMED:
        got, _, data = call(resident.url, "POST", path, body)
        assert got == status, f"{what}: {got} {data[:200]!r}"
        assert "error" in json.loads(data) if status == 400 else True, what
    assert call(resident.url, "GET", "/health")[0] == 200
    assert answer(resident.url, PROMPT, TOKENS) == expected(reference, PROMPT, TOKENS)


def test_health(resident):
    status, _, data = call(resident.url, "GET", "/health")
    assert (status, json.loads(data)) == (200, {"status": "ok"})


# ---------------------------------------------------------------------------- the KV cache


def test_kv_prealloc_serves_from_preallocated_caches(model_path, reference):
    """kv_context: each request's cache is a pyloader arena of that many tokens (the
    prompt cache then holds one whole arena), requests go one at a time, answers are the
    same."""
    with Server(model_path, ServeOptions(kv_context=512), port=0).start() as srv:
        assert srv.provider.is_batchable is False
        assert answer(srv.url, PROMPT, FEW) == expected(reference, PROMPT, FEW)
        arena = plan_kv_cache(srv.model, 512).nbytes
        assert srv.generator.prompt_cache.nbytes == arena
        # mlx-lm's own cache for these few tokens is one 256-token step: half of it
        assert arena == 2 * plan_kv_cache(srv.model, 256).nbytes
        prompts = ["The sky is", MESSAGES]
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: answer(srv.url, p, FEW), prompts))
        assert got == [expected(reference, p, FEW) for p in prompts]


def test_default_server_batches_with_mlx_lm_caches(resident):
    assert resident.provider.is_batchable is True
    assert resident.generator.prompt_cache.nbytes > 0


# ---------------------------------------------------------------------------- loading


class _Stop(Exception):
    pass


def _recording_load_model(seen: dict):
    """A stand-in for load_model that records its arguments and stops the load."""
    def fake(path, **kwargs):
        seen.update(kwargs, path=path)
        raise _Stop()

    return fake


def test_load_arguments_reach_load_model(model_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(serving_server, "load_model", _recording_load_model(seen))
    options = ServeOptions(pyloader.StreamOptions(strategy="pread", resident=3, prefetch=2,
                                                  experts=4), kernels="mlx")
    with pytest.raises(_Stop):
        Server(model_path, options, port=0, adapter_path="/adapters", chat_template="{{x}}",
               trust_remote_code=True)
    assert seen == {"path": model_path,
                    "options": pyloader.StreamOptions(strategy="pread", resident=3, prefetch=2,
                                                      experts=4),
                    "kernels": "mlx",
                    "adapter_path": "/adapters", "return_config": True,
                    "tokenizer_config": {"trust_remote_code": True,
                                         "chat_template": "{{x}}"},
                    "trust_remote_code": True}


def test_failed_load_raises_and_frees_the_port(tmp_path):
    before = threading.active_count()
    with pytest.raises(FileNotFoundError):
        Server(tmp_path, port=0)
    assert threading.active_count() == before  # mlx-lm's generation thread is gone


def test_server_defaults_are_mlx_lms(monkeypatch):
    """Every setting mlx_lm.server's own parser defines, with the same default: its
    handler and generator read them all from the namespace pyloader builds."""
    import mlx_lm.server as mlx_server

    captured = {}
    monkeypatch.setattr(mlx_server, "ModelProvider", lambda args: args)
    monkeypatch.setattr(mlx_server, "run", lambda host, port, args: captured.update(vars(args)))
    monkeypatch.setattr(mlx_server, "maybe_set_recommended_wired_limit", lambda: None)
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    monkeypatch.setattr(sys, "argv", ["mlx_lm.server"])
    mlx_server.main()
    assert captured == SERVER_DEFAULTS
    assert vars(server_args(max_tokens=7)) == {**SERVER_DEFAULTS, "max_tokens": 7}
    with pytest.raises(TypeError, match="not an mlx-lm server setting: max_token"):
        server_args(max_token=7)


# ---------------------------------------------------------------------------- the command


def test_serve_is_a_subcommand():
    assert "serve" in build_parser().format_help()


@contextlib.contextmanager
def serve_process(model_path, *flags):
    """`pyloader serve` on a free port in a process of its own (resident 0, pread, plus
    ``flags``): yields (process, url) once it says it is serving; killed if still alive."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyloader", "serve", "--model", model_path, "--port", "0",
         "--resident", "0", "--strategy", "pread", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/",
        # Ctrl-C reaches it even when these tests were started with SIGINT ignored (a
        # shell's background job): Python keeps an inherited SIG_IGN.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert "pyloader serve:" in line, line + proc.stderr.read()
        yield proc, line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_cli_serves_until_interrupted(model_path):
    """`pyloader serve` in a process of its own: flags reach the server (a request
    without max_tokens gets --max-tokens), Ctrl-C stops it cleanly."""
    with serve_process(model_path, "--max-tokens", "2") as (proc, line):
        assert "30 streamed units" in line
        url = line.split(" at ")[1].split()[0]
        assert call(url, "GET", "/health")[0] == 200
        r = post(url, "/v1/completions", {"prompt": PROMPT})
        assert r["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_cli_serves_a_gguf_file(tmp_path):
    """`pyloader serve` on a GGUF file (streamed with pread from the file): the greedy
    answer of the same file loaded in place with mlx-lm's generate."""
    from gguf_inplace_files import write_model

    path = tmp_path / "m.gguf"
    write_model(path, "qwen3", "Q4_K", embed="Q6_K", tied=True)
    model, tok = pyloader.load_model(path, kernels="auto")  # Q6_K: MLX's ops cannot
    want = mlx_lm.generate(model, tok, "ab a", max_tokens=4)
    with serve_process(str(path), "--kernels", "auto") as (proc, line):
        url = line.split(" at ")[1].split()[0]
        assert answer(url, "ab a", 4) == want
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_cli_errors(tmp_path, capsys):
    assert cli_main(["serve", "--model", str(tmp_path)]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(tmp_path), "--resident", "lots"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(tmp_path), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(tmp_path), "--kv-prealloc", "0"]) == 2
    assert "--kv-prealloc" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--resident", "1", "--budget", "1GB"])  # one or the other


# ------------------------------------------------- abuse: hostile or broken requests
#
# Each case below crashed, hung or dropped the connection before pyloader checked
# requests itself: the server must answer 400 with the reason and keep serving.

VOCAB = 49152  # SmolLM2's


HOSTILE = [
    ("token id = vocab size", {"logit_bias": {str(VOCAB): 100}}, "outside the vocabulary"),
    ("token id far out", {"logit_bias": {"60000": 1}}, "outside the vocabulary"),
    ("negative token id", {"logit_bias": {"-1": 1}}, "outside the vocabulary"),
    ("bias not a number", {"logit_bias": {"5": "x"}}, "logit_bias"),
    ("seed -1", {"seed": -1}, "seed"),
    ("seed 2**64", {"seed": 2 ** 64}, "seed"),
    ("seed a float", {"seed": 1.5}, "seed"),
    ("temperature NaN", {"temperature": float("nan")}, "temperature"),
    ("temperature inf", {"temperature": float("inf")}, "temperature"),
    ("top_p > 1", {"top_p": 1.5}, "top_p"),
    ("top_k > vocab", {"top_k": VOCAB + 1}, "top_k"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens > context", {"max_tokens": 10 ** 9}, "max_tokens"),
    ("max_tokens true", {"max_tokens": True}, "max_tokens"),
    ("prompt not a string", {"prompt": [1, 2, 3]}, "prompt"),
    ("stop not strings", {"stop": [1]}, "stop"),
    ("stream_options.include_usage", {"stream_options": {"include_usage": "yes"}},
     "include_usage"),
]


@pytest.mark.parametrize("what,fields,reason", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_fields_get_400_with_the_reason(resident, what, fields, reason):
    body = {"prompt": PROMPT, "max_tokens": 2, **fields}
    status, _, data = call(resident.url, "POST", "/v1/completions", body)
    assert status == 400, (what, status, data[:300])
    assert reason in json.loads(data)["error"], data
    assert call(resident.url, "GET", "/health")[0] == 200


def test_deeply_nested_json_gets_400(resident, reference):
    for depth in (100_000, 65):
        raw = b'{"prompt": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"
        status, _, data = call(resident.url, "POST", "/v1/completions", raw)
        assert status == 400, (depth, data[:200])
        assert "nests" in json.loads(data)["error"]
    assert answer(resident.url, PROMPT, TOKENS) == expected(reference, PROMPT, TOKENS)


def test_prompt_longer_than_the_context_gets_400(resident):
    """SmolLM2's context is 8192 tokens: a 9,001-token prompt is refused after
    tokenization, before any of it is processed."""
    assert resident.provider.context == 8192
    status, _, data = call(resident.url, "POST", "/v1/completions",
                           {"prompt": "hi " * 9000, "max_tokens": 1})
    assert status == 400, data[:300]
    assert "the model's context is 8192 tokens" in json.loads(data)["error"]


def test_oversized_body_gets_413_unread(model_path):
    with Server(model_path, port=0, max_request_bytes=1000).start() as srv:
        status, headers, data = call(srv.url, "POST", "/v1/completions",
                                     {"prompt": "x" * 2000})
        assert status == 413
        assert "at most 1000" in json.loads(data)["error"]


def test_valid_bias_seed_and_sampling_are_still_served(resident, reference):
    """The checks refuse only what is out of range: in-range values reach mlx-lm."""
    tok = reference[1]
    banned = tok.encode(" Paris")[0]
    r = post(resident.url, "/v1/completions",
             {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
              "logit_bias": {str(banned): -100}, "seed": 0, "top_k": VOCAB})
    assert expected(reference, PROMPT, 1) == "Paris"  # the greedy answer unbiased
    assert r["choices"][0]["text"] not in ("Paris", " Paris")


@contextlib.contextmanager
def listener():
    """A loopback HTTP server standing for an internal service: yields (its URL, the
    paths requested from it)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"not a png")

        def log_message(self, *args):
            pass

    side = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=side.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{side.server_address[1]}", seen
    finally:
        side.shutdown()
        side.server_close()
        thread.join()


NON_TEXT = [
    ("image_url", lambda url: {"type": "image_url", "image_url": {"url": url}}),
    ("image_url string", lambda url: {"type": "image_url", "image_url": url}),
    ("input_image", lambda url: {"type": "input_image", "image_url": url}),
    ("image", lambda url: {"type": "image", "image": url}),
    ("input_audio", lambda url: {"type": "input_audio",
                                 "input_audio": {"data": url, "format": "wav"}}),
    ("no type", lambda url: {"image_url": {"url": url}}),
]


@pytest.mark.parametrize("what,part", NON_TEXT, ids=[n[0] for n in NON_TEXT])
def test_non_text_content_is_refused_before_any_fetch(resident, what, part):
    """mlx-lm's chat handler fetched every image URL of a request from the server
    (urlopen, 30 s timeout, the whole body read) for any model, before anything else
    looked at the request: a client could make the server reach internal addresses.
    Any content part that is not text gets 400 naming it, and nothing is fetched."""
    with listener() as (url, seen):
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [
                        {"type": "text", "text": "What is this?"},
                        part(f"{url}/internal-secret")]}]
        for path in ("/v1/chat/completions", "/chat/completions"):
            for stream in (False, True):
                status, _, data = call(resident.url, "POST", path,
                                       {"messages": messages, "max_tokens": 2,
                                        "stream": stream})
                assert seen == [], f"{what}: the server fetched {seen} for the client"
                assert status == 400, (what, path, status, data[:300])
                assert "messages[1].content[1].type" in json.loads(data)["error"], data
    assert call(resident.url, "GET", "/health")[0] == 200


def test_text_content_parts_are_served(resident, reference):
    """A content list of text parts is still accepted: mlx-lm joins the parts, so the
    answer is that of the same text as a string."""
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Capital of "},
                                             {"type": "text", "text": "France?"}]}]
    r = post(resident.url, "/v1/chat/completions",
             {"messages": messages, "max_tokens": TOKENS, "temperature": 0})
    assert r["choices"][0]["message"]["content"] == expected(reference, MESSAGES, TOKENS)


# ---------------------------------------------------------------------------- the model is pinned


def test_a_request_cannot_name_another_model(resident, tmp_path):
    """Neither an existing directory nor a missing one is loaded, and the two answers are
    the same: the reply reveals nothing about the host's files."""
    answers = []
    for other in (str(tmp_path), str(tmp_path / "missing")):
        status, _, data = call(resident.url, "POST", "/v1/completions",
                               {"prompt": PROMPT, "max_tokens": 1, "model": other})
        assert status == 400, data[:300]
        answers.append(json.loads(data)["error"].replace(other, "X"))
    assert answers[0] == answers[1]
    for field in ("draft_model", "adapters"):
        status, _, data = call(resident.url, "POST", "/v1/completions",
                               {"prompt": PROMPT, "max_tokens": 1, field: str(tmp_path)})
        assert status == 400, (field, data[:300])
    assert resident.provider.model_key[0] == resident.cli_args.model  # nothing reloaded


def test_the_served_model_may_be_named(resident, reference, model_path):
    for name in ("default_model", model_path):
        r = post(resident.url, "/v1/completions",
                 {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "model": name})
        assert r["choices"][0]["text"] == expected(reference, PROMPT, TOKENS)
        assert r["model"] == name  # echoed as sent
    assert resident.provider.model_key[0] == resident.cli_args.model


def test_allow_client_models_is_refused_with_trust_remote_code(model_path):
    with pytest.raises(ValueError, match="trust_remote_code"):
        Server(model_path, port=0, allow_client_models=True, trust_remote_code=True)
    assert cli_main(["serve", "--model", model_path, "--allow-client-models",
                     "--trust-remote-code"]) == 2


@pytest.fixture(scope="module")
def two_vocabularies(tmp_path_factory, model_path) -> tuple[str, str]:
    """Two tiny llama models with SmolLM2's tokenizer: A with 60,000 tokens and a
    1024-token context, B with 50,000 and 512 (SmolLM2's ids are below 49,152)."""
    root = tmp_path_factory.mktemp("vocab")
    paths = []
    for name, vocab, context in (("a", 60000, 1024), ("b", 50000, 512)):
        path = make_model_dir(root / name, "llama", dtype=mx.float16, vocab_size=vocab,
                              max_position_embeddings=context)
        for f in Path(model_path).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, path / f.name)
        paths.append(str(path))
    return paths[0], paths[1]


def test_limits_are_those_of_the_model_the_request_names(two_vocabularies):
    """With --allow-client-models, a request naming model B while A is loaded was
    checked against A's vocabulary and context, then run on B: a logit_bias id valid
    for A but not for B reached MLX's unchecked scatter on B's logits (heap corruption).
    Each request is checked against the model that runs it, whichever was loaded when
    it arrived."""
    a, b = two_vocabularies
    with Server(a, port=0, allow_client_models=True).start() as srv:
        assert srv.provider.vocab_size == 60000
        # first with A loaded, then with B loaded (the first request loaded it)
        for loaded in (a, b):
            assert srv.provider.model_key[0] == loaded
            status, _, data = call(srv.url, "POST", "/v1/completions",
                                   {"prompt": PROMPT, "max_tokens": 1, "model": b,
                                    "logit_bias": {"50000": 1}})
            assert status == 400, (loaded, data[:300])
            error = json.loads(data)["error"]
            assert "logit_bias" in error and "50000" in error and "49999" in error, error
        for body, field in (({"logit_bias": {"50000": 1}, "stream": True}, "logit_bias"),
                            ({"top_k": 50001}, "top_k"), ({"max_tokens": 600}, "max_tokens")):
            status, _, data = call(srv.url, "POST", "/v1/completions",
                                   {"prompt": PROMPT, "max_tokens": 1, "model": b, **body})
            assert status == 400, (field, data[:300])
            assert field in json.loads(data)["error"], data
        # in range for the model that runs the request: served, whichever is loaded
        for model, token in ((b, "49999"), (a, "59999"), (b, "49999")):
            r = post(srv.url, "/v1/completions",
                     {"prompt": PROMPT, "max_tokens": 2, "model": model, "top_k": 50000,
                      "logit_bias": {token: 1}})
            assert r["usage"]["completion_tokens"] >= 1
            assert srv.provider.model_key[0] == model
        assert call(srv.url, "GET", "/health")[0] == 200


def test_a_narrower_draft_model_bounds_logit_bias(two_vocabularies):
    """Speculative decoding runs the request's logits processors on the draft model's
    logits too: with A (60,000 tokens) drafted by B (50,000), ids are checked against
    B's vocabulary."""
    a, b = two_vocabularies
    with Server(a, port=0, draft_model=b).start() as srv:
        assert srv.provider.draft_model is not None
        status, _, data = call(srv.url, "POST", "/v1/completions",
                               {"prompt": PROMPT, "max_tokens": 2,
                                "logit_bias": {"50000": 1}})
        assert status == 400, data[:300]
        assert "(0..49999)" in json.loads(data)["error"], data
        r = post(srv.url, "/v1/completions",
                 {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"49999": 1}})
        assert r["usage"]["completion_tokens"] >= 1


def test_models_endpoint_is_json_without_a_hub_cache(model_path, tmp_path, monkeypatch):
    """With no Hugging Face cache directory, mlx-lm's handler sent 200 and no body."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "none"))
    with Server(model_path, port=0, allow_client_models=True).start() as srv:
        status, _, data = call(srv.url, "GET", "/v1/models")
        assert status == 200
        ids = [m["id"] for m in json.loads(data)["data"]]
        assert ids == [model_path]
        status, _, data = call(srv.url, "GET", "/v1/models/nothing/here")
        assert (status, json.loads(data)["data"]) == (200, [])


def test_models_endpoint_lists_only_the_pinned_model(resident, model_path):
    status, _, data = call(resident.url, "GET", "/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(data)["data"]] == [model_path]


# ---------------------------------------------------------------------------- cancellation


def _eos_banned(reference) -> dict:
    tok = reference[1]
    return {str(t): -1000 for t in tok.eos_token_ids}


def _post_and_leave(server, body, passes: int, what: str) -> None:
    """POSTs ``body`` to ``server``'s /v1/completions on a raw socket and closes the
    connection without reading the answer once the streamed model has read ``passes``
    passes' worth of layers for it (``what`` has started)."""
    u = urlsplit(server.url)
    data = json.dumps(body).encode()
    start = pyloader.stats(server.model)["bytes_read"]
    per_pass = pyloader.stats(server.model)["streamed_bytes_per_pass"]
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 60
        while pyloader.stats(server.model)["bytes_read"] < start + passes * per_pass:
            assert time.monotonic() < deadline, f"{what} never started"
            time.sleep(0.02)
    finally:
        sock.close()


@pytest.mark.parametrize("seed", [None, 0], ids=["batched", "sequential"])
def test_generation_stops_when_the_client_disconnects(streamed, reference, seed):
    """A non-streaming request whose client leaves mid-generation: every token of the
    streamed model reads all its layers, so ``bytes_read`` shows whether the generation
    goes on. Without cancellation it runs on to max_tokens (200 tokens, minutes here)."""
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0,
            "logit_bias": _eos_banned(reference)}
    if seed is not None:
        body["seed"] = seed  # mlx-lm serves seeded requests one at a time
    start = pyloader.stats(streamed.model)["bytes_read"]
    per_pass = pyloader.stats(streamed.model)["streamed_bytes_per_pass"]
    _post_and_leave(streamed, body, passes=3, what="generation")
    time.sleep(2.0)  # the watcher polls every 0.1 s; the loop stops at the next token
    settled = pyloader.stats(streamed.model)["bytes_read"]
    time.sleep(3.0)
    after = pyloader.stats(streamed.model)["bytes_read"]
    assert after == settled, f"{(after - settled) / 2**20:.1f} MiB more read after the " \
                             "client left"
    assert settled < start + 100 * per_pass
    # and the server goes on serving
    assert answer(streamed.url, PROMPT, FEW) == expected(reference, PROMPT, FEW)


@pytest.mark.parametrize("seed", [None, 0], ids=["batched", "sequential"])
def test_prompt_processing_stops_when_the_client_disconnects(model_path, reference, seed):
    """A long prompt processed in 32-token steps, every step a pass over the streamed
    layers: once the client leaves, no more steps (mlx-lm's sequential path never looked
    at a request's stop flag during prompt processing)."""
    tok = reference[1]
    prompt = " ".join(["alpha beta gamma delta"] * 200)
    n = len(tok.encode(prompt))
    assert 600 < n < 2000
    with Server(model_path, ServeOptions(pyloader.StreamOptions(resident=0, prefetch=2)), port=0,
                prefill_step_size=32).start() as srv:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if seed is not None:
            body["seed"] = seed
        per_pass = pyloader.stats(srv.model)["streamed_bytes_per_pass"]
        start = pyloader.stats(srv.model)["bytes_read"]
        _post_and_leave(srv, body, passes=2, what="prompt processing")
        time.sleep(2.0)
        settled = pyloader.stats(srv.model)["bytes_read"]
        time.sleep(3.0)
        after = pyloader.stats(srv.model)["bytes_read"]
        steps = n // 32
        assert after == settled, f"{(after - settled) / 2**20:.1f} MiB more read"
        assert settled < start + (steps - 2) * per_pass, "the whole prompt was processed"
        assert answer(srv.url, PROMPT, FEW) == expected(reference, PROMPT, FEW)


# ---------------------------------------------------------------------------- the command


def test_cli_busy_port_names_the_port(model_path, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        assert cli_main(["serve", "--model", model_path, "--port", str(port)]) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err
    assert "--port 0" in err


def test_cli_drains_in_flight_requests_on_sigterm(model_path):
    """SIGTERM (a service manager stopping the server) lets a request in flight finish,
    as Ctrl-C does, and the process exits 0; it used to die at once."""
    with serve_process(model_path) as (proc, line):
        u = urlsplit(line.split(" at ")[1].split()[0])
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        conn.request("POST", "/v1/completions",
                     body=json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                      "stream": True}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        first = r.fp.readline()  # the first event: the request is in flight
        assert first.startswith(b"data: ") or first.startswith(b":"), first
        proc.send_signal(signal.SIGTERM)
        rest = r.read()
        conn.close()
        events = sse(first + rest)
        text = "".join(e["choices"][0]["text"] for e in events)
        assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert text
        assert proc.wait(timeout=60) == 0
