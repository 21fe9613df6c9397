"""What a request, a chat template or a change on disk may do to ``pyloader serve``:
fail one request, never the server. Real servers on loopback, the default model."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from test_serve_fuzz import PROMPT, send

from pyloader import StreamOptions
from pyloader.default_model import default_model_path
from pyloader.serving import ServeOptions
from pyloader.serving.server import Server, ServerFailed

CHAT = [{"role": "user", "content": "Capital of France?"}]


def ordinary(url: str) -> tuple[int, str | None]:
    status, data = send(url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    return status, json.loads(data)["choices"][0]["text"] if status == 200 else None


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("model") / "m"
    shutil.copytree(default_model_path(), dst)
    return dst


@pytest.fixture(scope="module")
def resident(model_copy):
    with Server(str(model_copy), port=0, template_timeout_s=1.0).start() as srv:
        yield srv


def rss_peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


# ---------------------------------------------------------------- every request fails alone


@pytest.mark.parametrize("seed", [None, 0], ids=["batched", "sequential"])
def test_empty_prompt_is_400_and_the_server_goes_on(resident, seed):
    want = ordinary(resident.url)
    body = {"prompt": "", "max_tokens": 2}
    if seed is not None:
        body["seed"] = seed
    status, data = send(resident.url, "/v1/completions", body)
    assert status == 400 and "prompt" in json.loads(data)["error"], data
    assert ordinary(resident.url) == want


def test_a_failure_inside_the_batch_fails_its_requests_alone(resident, monkeypatch):
    """An exception where mlx-lm's batched loop does not catch it (a batch step): the
    requests in it get 500, the loop starts again, the next request is answered."""
    want = ordinary(resident.url)
    mlx_generate = importlib.import_module("mlx_lm.generate")

    real = mlx_generate.BatchGenerator.next
    calls = {"n": 0}

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected batch failure")
        return real(self, *a, **k)

    monkeypatch.setattr(mlx_generate.BatchGenerator, "next", failing)
    restarts = resident.generator.restarts
    status, data = send(resident.url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert status == 500 and "injected batch failure" in json.loads(data)["error"], data
    assert resident.generator.restarts == restarts + 1
    monkeypatch.undo()
    assert ordinary(resident.url) == want
    assert resident.failure is None


def test_a_dead_generation_thread_stops_the_server(model_copy, monkeypatch, capfd):
    """Failing over and over (here: every batch step) ends the generation thread; the
    server says so on stderr and serve_forever raises, so the process exits non-zero."""
    mlx_generate = importlib.import_module("mlx_lm.generate")

    def failing(self, *a, **k):
        raise RuntimeError("injected persistent failure")

    srv = Server(str(model_copy), port=0)
    try:
        monkeypatch.setattr(mlx_generate.BatchGenerator, "next", failing)
        srv.start()
        for _ in range(8):
            status, _ = send(srv.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
            assert status in (500, 503, None)
            if srv.failure is not None:
                break
        deadline = time.monotonic() + 10
        while srv.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(srv.failure, ServerFailed)
        assert "injected persistent failure" in str(srv.failure)
        assert "generation thread died" in capfd.readouterr().err
        with pytest.raises(ServerFailed):
            srv.serve_forever()
    finally:
        srv.close()


# ---------------------------------------------------------------- templates belong to the model

TEMPLATE_BOMB = "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}"


@pytest.mark.parametrize("key,value", [
    ("chat_template", TEMPLATE_BOMB), ("tokenize", False), ("return_tensors", "np"),
    ("truncation", True), ("max_length", 1), ("padding", True), ("tools", [])])
def test_client_template_and_tokenizer_options_get_400(resident, key, value):
    before = rss_peak_kib()
    status, data = send(resident.url, "/v1/chat/completions",
                        {"messages": CHAT, "max_tokens": 2,
                         "chat_template_kwargs": {key: value}})
    assert status == 400, data
    assert f"chat_template_kwargs.{key}" in json.loads(data)["error"]
    assert rss_peak_kib() - before < 50 * 1024  # the peak did not move (50 MiB slack)


def test_allowed_template_kwargs_are_served(resident):
    status, data = send(resident.url, "/v1/chat/completions",
                        {"messages": CHAT, "max_tokens": 2, "temperature": 0,
                         "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, data


def test_a_looping_model_template_fails_its_request_within_the_bound(resident, monkeypatch):
    """The model's own template loops: its request fails (500) after the bound (1 s
    here), and the next request is answered at once, the render stopped."""
    want = ordinary(resident.url)
    tok = resident.provider.tokenizer
    monkeypatch.setattr(tok._tokenizer, "chat_template",
                        "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}"
                        "{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    status, data = send(resident.url, "/v1/chat/completions",
                        {"messages": CHAT, "max_tokens": 2})
    took = time.monotonic() - t0
    assert status == 500 and "bound" in json.loads(data)["error"], data
    assert took < 5, took
    monkeypatch.undo()
    t0 = time.monotonic()
    assert ordinary(resident.url) == want
    assert time.monotonic() - t0 < 3
    time.sleep(0.5)
    import threading
    assert not [t for t in threading.enumerate() if t.name == "pyloader-template"]


# ---------------------------------------------------------------- a streamed server and its files


@pytest.fixture(scope="module")
def streamed(model_copy):
    with Server(str(model_copy), ServeOptions(StreamOptions(resident=0.5)), port=0).start() as srv:
        yield srv


@pytest.mark.parametrize("change", ["hardlink", "chmod", "touch"])
def test_metadata_changes_are_not_rewrites(streamed, model_copy, change):
    want = ordinary(streamed.url)
    assert want[0] == 200
    shard = model_copy / "model.safetensors"
    if change == "hardlink":
        os.link(shard, model_copy.parent / "extra-link")
        assert ordinary(streamed.url) == want
        os.unlink(model_copy.parent / "extra-link")
    elif change == "chmod":
        os.chmod(shard, 0o600)
        assert ordinary(streamed.url) == want
        os.chmod(shard, 0o644)
    else:
        time.sleep(0.02)
        os.utime(shard)
    assert ordinary(streamed.url) == want
    assert streamed.failure is None


def test_a_real_rewrite_fails_cleanly_then_reopens(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(default_model_path(), model)
    with Server(str(model), ServeOptions(StreamOptions(resident=0.5)), port=0).start() as srv:
        want = ordinary(srv.url)
        shard = model / "model.safetensors"
        data = bytearray(shard.read_bytes())
        half = len(data) // 2
        keep = bytes(data[half:])
        data[half:] = bytes(len(keep))  # same size, same inode, other bytes
        with open(shard, "r+b") as fh:
            fh.write(data)
        status, body = send(srv.url, "/v1/completions",
                            {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert status == 500, body
        assert "changed on disk" in json.loads(body)["error"]
        # the server reopened the checkpoint: it serves the new bytes (a valid
        # checkpoint with other weights), never "generation thread died"
        status, _ = ordinary(srv.url)
        assert status == 200
        assert srv.failure is None and srv.generator.generation_available()
