"""``pyloader.trace``: a Chrome trace-event timeline of every streamed unit (request, wait,
compute, release, eviction) and of the reader threads, for both read paths, with and
without prefetch; the readers' bounded trace buffers; ``pyloader generate --trace``."""

from __future__ import annotations

import json
import sys
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import pyloader
from models import make_model_dir
from pyloader.cli import main
from pyloader.errors import PlotsUnavailable
from pyloader.streaming import controller_of
from pyloader.streaming.trace import plot_trace

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 5, 9, 11, 200]
N_TOKENS = 6
#: ts and dur are written in microseconds to three decimals, each rounded on its own: a
#: sum of two can be off by a nanosecond, never more (both clocks are CLOCK_MONOTONIC).
ROUNDING_US = 0.002


def greedy(model) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS)]


def end(e: dict) -> float:
    return e["ts"] + e["dur"]


def check_chrome(data: dict) -> list[dict]:
    """A valid Chrome trace-event object; returns its complete ("X") events."""
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    for e in data["traceEvents"]:
        assert {"ph", "pid", "tid", "name"} <= set(e), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            assert e["cat"] and isinstance(e["args"], dict), e
        elif e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index"), e
            assert isinstance(e["args"], dict), e
        else:
            assert e["ph"] in ("s", "t", "f") and "id" in e and "ts" in e, e
    return [e for e in data["traceEvents"] if e["ph"] == "X"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Two bf16 layers written by mx.save_safetensors (misaligned: mmap copies some
    tensors at every use, so its "copy" reads are traced too)."""
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
@pytest.mark.parametrize("prefetch", [1, 0])
def test_every_streamed_unit_every_pass(llama, tmp_path, strategy, prefetch):
    model, _ = pyloader.load_model(
        llama, resident=0, options=pyloader.StreamOptions(strategy=strategy, prefetch=prefetch))
    ctl = controller_of(model)
    assert ctl.timeline is None  # off unless asked for
    untraced = greedy(model)
    before = pyloader.stats(model)["passes"]
    with pyloader.trace(model, tmp_path / "t.json", png=tmp_path / "t.png") as timeline:
        assert ctl.timeline is timeline
        traced = greedy(model)
    assert ctl.timeline is None
    assert traced == untraced
    passes = range(before + 1, pyloader.stats(model)["passes"] + 1)
    assert len(passes) >= N_TOKENS

    data = json.loads((tmp_path / "t.json").read_text())
    x = check_chrome(data)
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    units = {u.name: u for u in ctl.layout.units}
    assert {u["name"]: u["bytes"] for u in data["otherData"]["units"]} == {
        n: u.nbytes for n, u in units.items()}
    assert len(units) == 2

    compute_tid = threading.get_native_id()
    unit_events = [e for e in x if "reader_thread" not in e["args"] and e["cat"] != "pass"]
    assert {e["tid"] for e in unit_events} == {compute_tid}
    by = {}
    for e in unit_events:
        by.setdefault((e["cat"], e["name"], e["args"]["pass"]), []).append(e)
    cats = ("wait", "compute", "release")
    for name in units:
        for p in passes:
            for cat in cats:
                assert len(by.get((cat, name, p), [])) == 1, (cat, name, p)
    assert [e["args"]["pass"] for e in x if e["cat"] == "pass"] == list(passes)

    reads = [e for e in x if e["cat"] == "read"]
    assert reads and all("reader_thread" in e["args"] for e in reads)
    requested = {e["args"]["ticket"] for e in x if e["cat"] == "request"}
    assert bool(requested) == bool(prefetch)
    for req in (e for e in x if e["cat"] == "request"):
        # A request is read for its unit after it was issued, and waited for by it.
        ticket = req["args"]["ticket"]
        fed = [e for e in reads if e["args"]["ticket"] == ticket]
        waited = [e for e in x if e["cat"] == "wait" and e["args"]["ticket"] == ticket]
        assert len(fed) <= 1 and len(waited) <= 1
        for e in fed + waited:
            assert e["name"] == req["name"] and req["ts"] <= e["ts"] + ROUNDING_US, (req, e)
    checked = 0
    for name, unit in units.items():
        copied = sum(unit.sources[p].nbytes for p in unit.copied)
        for p in passes:
            wait = by[("wait", name, p)][0]
            compute = by[("compute", name, p)][0]
            # Its weights are in before it computes, which comes after the wait.
            assert end(wait) <= compute["ts"] + ROUNDING_US
            ticket = wait["args"]["ticket"]
            if ticket is not None and ticket not in requested:
                continue  # requested before the recording began
            if ticket is not None:
                feeding = [e for e in reads if e["args"]["ticket"] == ticket]
            else:  # read while it waited
                feeding = [e for e in reads if e["name"] == name
                           and wait["ts"] <= e["ts"] and end(e) <= end(wait) + ROUNDING_US]
            main_read = [e for e in feeding if e["args"]["kind"] in ("populate", "read")]
            assert len(main_read) == 1, (name, p, feeding)
            read = main_read[0]
            assert read["name"] == name and read["args"]["bytes"] == unit.nbytes
            assert read["args"]["layer"] == unit.layer
            # The read completed before the wait for it ended.
            assert end(read) <= end(wait) + ROUNDING_US
            checked += 1
            if strategy == "mmap" and copied:
                # Misaligned tensors are copied while the unit waits, drawn in its wait.
                copies = [e for e in reads if e["args"]["kind"] == "copy"
                          and wait["ts"] <= e["ts"] and end(e) <= end(wait) + ROUNDING_US]
                assert [c["args"]["bytes"] for c in copies] == [copied]
                assert copies[0]["tid"] == compute_tid and copies[0]["name"] == name
    assert checked >= 2 * (len(passes) - 1)

    if strategy == "pread":  # drops what it read from the page cache, on the reader
        evicts = [e for e in x if e["cat"] == "evict"]
        assert evicts and all("reader_thread" in e["args"] for e in evicts)
    else:
        # Release and eviction run on the reader's worker, never on the compute thread:
        # one of each per unit per pass.
        for cat in ("release", "evict"):
            done = [e for e in x if e["cat"] == cat and "reader_thread" in e["args"]]
            assert len(done) == len(units) * len(passes), cat
            assert compute_tid not in {e["tid"] for e in done}
            assert {e["args"]["kind"] for e in done} == {
                "release" if cat == "release" else "release-evict"}
    if prefetch:
        # Background work runs on the reader's own thread, named in the trace.
        background = {e["tid"] for e in reads if e["args"]["ticket"]}
        assert background and compute_tid not in background
        names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        assert all(names[t].startswith("reader") for t in background)
        assert names[compute_tid] == "compute (Python)"
        flows = [e for e in data["traceEvents"] if e["ph"] in ("s", "f")]
        assert flows and {e["id"] for e in flows} <= requested

    summary = data["otherData"]["summary"]
    assert summary == timeline.summary()
    assert summary["passes"] == len(passes) and summary["streamed_units"] == 2
    assert summary["compute_thread_s"]["compute"] > 0 and summary["bytes_read"] > 0
    assert summary["dropped_events"] == 0


def test_clocks_agree():
    """The readers' steady_clock and Python's monotonic clock are one clock."""
    t0 = time.monotonic_ns()
    c = pyloader.core.trace_clock_ns()
    t1 = time.monotonic_ns()
    if sys.platform.startswith("linux"):
        assert t0 <= c <= t1
    else:
        assert abs(c - t0) < 10**9


def test_reader_trace_buffers(llama):
    ckpt = pyloader.open(llama)
    names = [t.name for t in ckpt.tensors()][:3]
    nbytes = sum(ckpt[n].nbytes for n in names)
    r = pyloader.MmapReader(ckpt)
    r.wait(r.prefetch(names, "populate"))
    assert r.take_trace() == ([], 0)  # off by default: nothing recorded
    r.trace_enable(True, capacity=1)
    t1 = r.prefetch(names, "populate")
    r.wait(t1)
    r.wait(r.prefetch(names, "willneed"))
    events, dropped = r.take_trace()
    assert dropped == 1 and len(events) == 1  # bounded
    kind, ticket, tid, start, stop, b = events[0]
    assert (kind, ticket, b) == ("populate", t1, nbytes)
    assert 0 < start <= stop <= time.monotonic_ns() and tid != threading.get_native_id()
    r.trace_enable(False)
    r.wait(r.prefetch(names))
    assert r.take_trace() == ([], 0)

    p = pyloader.PreadReader(ckpt, drop_cache=True)
    p.trace_enable()
    t = p.submit(names)
    p.take(t)
    p.load(names)
    events, dropped = p.take_trace()
    assert dropped == 0
    assert [(e[0], e[1], e[5]) for e in events] == [
        ("read", t, nbytes), ("evict", t, nbytes), ("read", 0, nbytes), ("evict", 0, nbytes)]
    assert all(e[3] <= e[4] for e in events)
    assert events[0][4] <= events[1][3]  # evicted after it was read


def test_a_model_without_streamed_units(llama, tmp_path, caplog):
    model, _ = pyloader.load_model(llama, resident=1.0)
    with (caplog.at_level("WARNING"),
          pyloader.trace(model, tmp_path / "t.json", png=tmp_path / "t.png") as timeline):
        greedy(model)
    data = json.loads((tmp_path / "t.json").read_text())
    assert check_chrome(data) == []  # valid, with no unit events
    assert "no streamed units" in data["otherData"]["summary"]["note"]
    assert "no streamed units" in caplog.text
    assert timeline.summary()["passes"] == 0
    assert (tmp_path / "t.png").stat().st_size > 0


def test_recording_is_exclusive_and_bounded(llama, tmp_path):
    model, _ = pyloader.load_model(llama, resident=0)
    ctl = controller_of(model)
    with pyloader.trace(model, tmp_path / "t.json", max_events=10):
        with pytest.raises(RuntimeError, match="already"):
            ctl.start_timeline()
        greedy(model)
    summary = json.loads((tmp_path / "t.json").read_text())["otherData"]["summary"]
    assert summary["dropped_events"] > 0
    assert ctl.timeline is None and ctl.stop_timeline() is None
    # A block that raises still gets its trace.
    with pytest.raises(KeyError), pyloader.trace(model, tmp_path / "err.json"):
        greedy(model)
        raise KeyError("boom")
    assert check_chrome(json.loads((tmp_path / "err.json").read_text()))
    assert ctl.timeline is None
    plot_trace(tmp_path / "err.json", tmp_path / "again.png")  # from the saved file
    assert (tmp_path / "again.png").read_bytes()[:4] == b"\x89PNG"


def test_png_without_matplotlib_fails_up_front(llama, tmp_path, monkeypatch):
    model, _ = pyloader.load_model(llama, resident=0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with (pytest.raises(PlotsUnavailable, match="pip install"),
          pyloader.trace(model, tmp_path / "t.json", png=tmp_path / "t.png")):
        pytest.fail("recorded without its PNG")
    assert not (tmp_path / "t.json").exists() and controller_of(model).timeline is None
    with pyloader.trace(model, tmp_path / "t.json"):  # the JSON needs no matplotlib
        greedy(model)
    check_chrome(json.loads((tmp_path / "t.json").read_text()))


# ---------------------------------------------------------------------------- CLI


def test_generate_trace_writes_json_and_png(tmp_path, capsys):
    from pyloader.default_model import default_model_path

    model = str(default_model_path())
    out = tmp_path / "t.json"
    assert main(["generate", model, "--prompt", "The capital of France is",
                 "--ignore-chat-template", "--max-tokens",
                 "2", "--resident", "0", "--trace", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"trace: {out} and {tmp_path / 't.png'}" in err and "passes x 30" in err
    x = check_chrome(json.loads(out.read_text()))
    assert {e["cat"] for e in x} >= {"wait", "compute", "release", "evict", "read", "pass"}
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"

    png = tmp_path / "elsewhere.png"
    assert main(["generate", model, "--prompt", "Hi", "--max-tokens", "1", "--trace",
                 str(tmp_path / "all.json"), "--trace-png", str(png)]) == 0
    assert "no streamed units" in capsys.readouterr().err  # every layer resident
    assert png.stat().st_size > 0 and not (tmp_path / "all.png").exists()


def test_generate_trace_arguments(tmp_path, capsys, monkeypatch):
    from pyloader.default_model import default_model_path

    model = str(default_model_path())
    assert main(["generate", model, "--prompt", "x", "--trace-png", str(tmp_path / "a.png")]) == 2
    assert "--trace-png needs --trace" in capsys.readouterr().err
    assert main(["generate", model, "--prompt", "x", "--trace",
                 str(tmp_path / "missing" / "a.json")]) == 2
    assert "no such directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # An explicit PNG without matplotlib: an error before anything is loaded.
    assert main(["generate", model, "--prompt", "x", "--trace", str(tmp_path / "a.json"),
                 "--trace-png", str(tmp_path / "a.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err and not (tmp_path / "a.json").exists()
    # The default PNG is skipped, with a word; the JSON is still written.
    assert main(["generate", model, "--prompt", "x", "--max-tokens", "1", "--resident", "0",
                 "--trace", str(tmp_path / "b.json")]) == 0
    assert "no PNG summary" in capsys.readouterr().err
    assert (tmp_path / "b.json").exists() and not (tmp_path / "b.png").exists()
