"""Head bundles: build checks, swaps bit-exact with each variant's full
checkpoint through mlx-lm, atomic failures, preload without disk I/O."""

from __future__ import annotations

import gc
import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load

import pyloader
from helpers import tensor_bytes, write_raw_safetensors
from models import logits, make_model_dir
from proc_files import require_proc
from pyloader._util.host import io_counters
from pyloader import heads
from pyloader.cli import main as cli_main
from benchlib.synthetic import make_variant

#: SwapStats.rchar of a swap that reads nothing: 0, or None where the platform (or
#: PYLOADER_NO_PROC) has no bytes-through-read-calls counter.
NO_READ_CALLS = 0 if io_counters().rchar is not None else None

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]
CASES = {
    "llama-bf16": ("llama", None),
    "qwen3-bf16": ("qwen3", None),   # tied embeddings: lm_head is the trunk's embedding
    "llama-4bit": ("llama", 4),
}
TAIL = 1


def greedy(model, n=8) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def reference(path: Path):
    model, _ = mlx_lm_load(path)
    return tensor_bytes(logits(model, PROMPT)), greedy(model)


@pytest.fixture(scope="module", params=sorted(CASES))
def bundle_case(request, tmp_path_factory):
    arch, bits = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    base = make_model_dir(root / "base", arch, dtype=mx.bfloat16, bits=bits)
    variants = {"base": base}
    for i, name in enumerate(["chat", "code"], start=1):
        variants[name] = make_variant(base, root / name, TAIL, seed=i, scale=0.5)
    out = root / "bundle"
    heads.build(base, variants, TAIL, out)
    refs = {name: reference(path) for name, path in variants.items()}
    # The variants really differ: otherwise a swap could not be told apart.
    assert len({r[0] for r in refs.values()}) == 3
    return out, variants, refs


def head_file_copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(bundle, dst)
    return dst


def test_bundle_layout(bundle_case):
    out, variants, _ = bundle_case
    b = heads.Bundle(out)
    assert b.names == ["base", "chat", "code"] and b.tail == TAIL
    trunk = b.trunk
    head_names = set(b.head_tensors())
    base_names = set(pyloader.open(variants["base"]).keys())
    assert set(trunk.keys()) | head_names == base_names
    assert not set(trunk.keys()) & head_names
    layers = heads.num_layers(base_names)
    assert all(heads.is_head_tensor(n, layers, TAIL) for n in head_names)
    for name in b.names:
        ck = pyloader.open(b.head_file(name))
        for t in ck.tensors() + trunk.tensors():
            assert t.offset % 16384 == 0, t.name
        for t in ck.tensors():
            assert b.entry(name)["tensors"][t.name]["crc32"] == \
                __import__("zlib").crc32(tensor_bytes(pyloader.load(b.head_file(name),
                                                                    names=[t.name])[t.name]))


def test_swaps_match_each_variant_bit_for_bit(bundle_case):
    out, _, refs = bundle_case
    model, _ = pyloader.load_model(out, head="chat")
    assert model.current_head == "chat"
    for name in ["chat", "code", "base", "chat", "code"]:
        if name != model.current_head:
            stats = model.swap_head(name)
            assert stats.head == name and not stats.warm
        assert tensor_bytes(logits(model, PROMPT)) == refs[name][0], name
        assert greedy(model) == refs[name][1], name
    assert [n for _, n in model.head_usage.history] == ["chat", "code", "base", "chat", "code"]


def test_default_head_is_the_first(bundle_case):
    out, _, refs = bundle_case
    model, _ = pyloader.load_model(out)
    assert model.current_head == "base"
    assert greedy(model) == refs["base"][1]


def test_trunk_untouched_and_old_head_released(bundle_case):
    out, _, _ = bundle_case
    model, _ = pyloader.load_model(out, head="chat")
    mgr = heads.manager_of(model)
    head_params = set(mgr.head_params.values())
    before = dict(tree_flatten(model.parameters()))
    model.swap_head("code")
    after = dict(tree_flatten(model.parameters()))
    for p in before:
        if p in head_params:
            assert after[p] is not before[p], p
        else:
            assert after[p] is before[p], p  # the very same trunk array objects
    del before, after
    gc.collect()
    require_proc("/proc/self/maps")
    maps = Path("/proc/self/maps").read_text()
    assert str(out / "heads" / "code.safetensors") in maps
    assert str(out / "heads" / "chat.safetensors") not in maps  # old head unmapped


def test_warm_swap_reads_nothing(bundle_case):
    out, _, refs = bundle_case
    model, _ = pyloader.load_model(out, head="chat")
    cold = model.swap_head("code")
    assert not cold.warm
    assert cold.populate_bytes == cold.head_bytes > 0  # the counters do count
    # ... and the pages are there: populate brings them in without a read call (no
    # rchar), mapped by the head's reader.
    r = heads.manager_of(model).active.reader
    assert all(r.resident_bytes(n) >= r.checkpoint[n].nbytes for n in r.checkpoint.keys())
    model.preload_heads(["chat", "base"], wait=True)
    assert sorted(model.preloaded_heads) == ["base", "chat"]
    ticket_reader = heads.manager_of(model).preloaded["chat"].reader
    assert all(ticket_reader.resident_bytes(n) >= ticket_reader.checkpoint[n].nbytes
               for n in ticket_reader.checkpoint.keys())
    warm = model.swap_head("chat")
    assert warm.warm
    assert warm.populate_bytes == 0 and warm.bytes_read == 0
    # No read at all, page cache or disk (rchar: None where the platform has no such counter).
    assert warm.rchar == NO_READ_CALLS and warm.read_bytes == 0
    assert greedy(model) == refs["chat"][1]
    assert model.preloaded_heads == ["base"]
    model.release_preloaded_heads()
    assert model.preloaded_heads == []


def test_preload_runs_in_the_background(bundle_case):
    out, _, refs = bundle_case
    model, _ = pyloader.load_model(out, head="chat")
    model.preload_heads(["code"])  # returns at once; the swap waits for it
    assert greedy(model) == refs["chat"][1]  # the model keeps working meanwhile
    stats = model.swap_head("code")
    assert stats.warm and stats.populate_bytes == 0
    assert greedy(model) == refs["code"][1]


def corrupt_byte(file: Path, tensor: str) -> None:
    t = pyloader.open(file)[tensor]
    with open(file, "r+b") as f:
        f.seek(t.offset + t.nbytes // 2)
        b = f.read(1)
        f.seek(t.offset + t.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("preloaded", [False, True])
def test_corrupt_head_leaves_previous_head_working(bundle_case, tmp_path, preloaded):
    out, _, refs = bundle_case
    bundle = head_file_copy(out, tmp_path)
    victim = heads.Bundle(bundle).head_tensors()[-1]
    corrupt_byte(bundle / "heads" / "code.safetensors", victim)
    model, _ = pyloader.load_model(bundle, head="chat")
    if preloaded:
        model.preload_heads(["code"], wait=False)
    with pytest.raises(heads.HeadChecksumError, match="CRC-32") as exc:
        model.swap_head("code")
    assert exc.value.tensor == victim and exc.value.head == "code"
    assert "code.safetensors" in str(exc.value)
    assert model.current_head == "chat" and model.preloaded_heads == []
    assert greedy(model) == refs["chat"][1]
    model.swap_head("base")  # and the model still swaps to good heads
    assert greedy(model) == refs["base"][1]


def rewrite_head(file: Path, change) -> None:
    """Rewrite a head file with `change(dict name -> (dtype, shape, bytes))`."""
    from safetensors import deserialize

    pads = pyloader.open(file).padding_names
    entries = {n: (t["dtype"], t["shape"], bytes(t["data"]))
               for n, t in deserialize(file.read_bytes()) if n not in pads}
    change(entries)
    write_raw_safetensors(file, entries)


def test_missing_tensor(bundle_case, tmp_path):
    out, _, refs = bundle_case
    bundle = head_file_copy(out, tmp_path)
    victim = heads.Bundle(bundle).head_tensors()[0]
    rewrite_head(bundle / "heads" / "code.safetensors", lambda e: e.pop(victim))
    model, _ = pyloader.load_model(bundle, head="chat")
    with pytest.raises(heads.HeadMismatchError, match="missing") as exc:
        model.swap_head("code")
    assert exc.value.tensor == victim
    assert model.current_head == "chat" and greedy(model) == refs["chat"][1]


def test_shape_mismatch(bundle_case, tmp_path):
    out, _, refs = bundle_case
    bundle = head_file_copy(out, tmp_path)
    victim = next(n for n in heads.Bundle(bundle).head_tensors() if n.endswith("norm.weight"))

    def halve(e):
        d, s, b = e[victim]
        e[victim] = (d, [s[0] // 2], b[:len(b) // 2])

    rewrite_head(bundle / "heads" / "code.safetensors", halve)
    model, _ = pyloader.load_model(bundle, head="chat")
    with pytest.raises(heads.HeadMismatchError, match="dtype/shape") as exc:
        model.swap_head("code")
    assert exc.value.tensor == victim
    assert greedy(model) == refs["chat"][1]


def test_quantization_mismatch_at_swap(tmp_path):
    """A head whose packed weights differ in bits (the directory agreeing)
    is refused against the model before anything changes."""
    base = make_model_dir(tmp_path / "b4", "llama", dtype=mx.bfloat16, bits=4)
    other = make_model_dir(tmp_path / "b8", "llama", dtype=mx.bfloat16, bits=8)
    out = tmp_path / "bundle"
    heads.build(base, {"a": base}, TAIL, out)
    heads.build(other, {"b": other}, TAIL, tmp_path / "b8bundle")
    # Graft the 8-bit head (file and directory entry) into the 4-bit bundle.
    shutil.copy(tmp_path / "b8bundle" / "heads" / "b.safetensors", out / "heads" / "b.safetensors")
    trunk = out / "trunk.safetensors"
    raw = trunk.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    d = json.loads(header["__metadata__"]["pyloader.heads"])
    d["heads"]["b"] = json.loads(
        pyloader.open(tmp_path / "b8bundle" / "trunk.safetensors").metadata()["pyloader.heads"]
    )["heads"]["b"]
    header["__metadata__"]["pyloader.heads"] = json.dumps(d)
    text = json.dumps(header).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    trunk.write_bytes(raw[:8] + text + raw[8 + n:])
    model, _ = pyloader.load_model(out, head="a")
    want = greedy(model)
    with pytest.raises(heads.HeadMismatchError, match="quantization mismatch"):
        model.swap_head("b")
    assert model.current_head == "a" and greedy(model) == want


def test_unknown_and_missing_head_files(bundle_case, tmp_path):
    out, _, refs = bundle_case
    bundle = head_file_copy(out, tmp_path)
    (bundle / "heads" / "code.safetensors").unlink()
    model, _ = pyloader.load_model(bundle, head="chat")
    with pytest.raises(heads.UnknownHeadError, match="no such head") as exc:
        model.swap_head("nope")
    assert isinstance(exc.value, KeyError)
    with pytest.raises(heads.HeadIOError, match="cannot open") as exc2:
        model.swap_head("code")
    assert isinstance(exc2.value, OSError)
    with pytest.raises(heads.UnknownHeadError):
        model.preload_heads(["base", "nope"])
    assert model.preloaded_heads == []  # nothing started
    assert model.current_head == "chat" and greedy(model) == refs["chat"][1]
    with pytest.raises(heads.UnknownHeadError):
        pyloader.load_model(bundle, head="nope")


def test_build_refuses_a_different_trunk(bundle_case, tmp_path):
    out, variants, _ = bundle_case
    bad = tmp_path / "bad"
    shutil.copytree(variants["chat"], bad)
    w = mx.load(str(bad / "model.safetensors"))
    victim = next(n for n in sorted(w) if ".layers.0." in n and mx.issubdtype(w[n].dtype,
                                                                             mx.floating))
    w[victim] = w[victim] + 1
    mx.save_safetensors(str(bad / "model.safetensors"), w, metadata={"format": "mlx"})
    with pytest.raises(heads.TrunkMismatchError, match="byte-identical") as exc:
        heads.build(variants["base"], {"ok": variants["chat"], "bad": bad}, TAIL, tmp_path / "o")
    assert exc.value.tensor == victim and exc.value.head == "bad"
    assert not (tmp_path / "o").exists()
    # The same variant is fine when that layer is part of the head.
    layers = heads.num_layers(w)
    heads.build(variants["base"], {"bad": bad}, layers, tmp_path / "o")


def test_build_refuses_other_quantization(tmp_path):
    base = make_model_dir(tmp_path / "b4", "llama", dtype=mx.bfloat16, bits=4)
    other = make_model_dir(tmp_path / "b8", "llama", dtype=mx.bfloat16, bits=8)
    with pytest.raises(heads.HeadMismatchError, match="quantization") as exc:
        heads.build(base, {"b8": other}, TAIL, tmp_path / "o")
    assert exc.value.head == "b8"
    # Same config but different packed shapes (the config lies): still refused.
    cfg = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((heads.HeadMismatchError, heads.TrunkMismatchError), match="differs"):
        heads.build(base, {"b8": other}, TAIL, tmp_path / "o")


def test_build_argument_checks(bundle_case, tmp_path):
    _, variants, _ = bundle_case
    with pytest.raises(ValueError, match="tail"):
        heads.build(variants["base"], {"a": variants["chat"]}, 0, tmp_path / "o")
    with pytest.raises(ValueError, match="head name"):
        heads.build(variants["base"], {"../x": variants["chat"]}, 1, tmp_path / "o")


def test_usage_history_and_auto_preload(bundle_case):
    out, _, refs = bundle_case
    model, _ = pyloader.load_model(out, head="chat")
    for name in ["code", "chat", "code", "chat"]:
        model.swap_head(name)
    usage = model.head_usage
    assert usage.counts() == {"chat": 3, "code": 2}
    assert usage.transitions()["chat"] == {"code": 2}
    assert usage.likely_next("chat", model.head_names, 2) == ["code", "base"]
    model.auto_preload_heads(2)
    mgr = heads.manager_of(model)
    for h in mgr.preloaded.values():
        h.future.result()
    assert sorted(model.preloaded_heads) == ["base", "code"]
    stats = model.swap_head("code")
    assert stats.warm and stats.populate_bytes == 0 and stats.rchar == NO_READ_CALLS
    assert greedy(model) == refs["code"][1]
    # The previous head stays in memory: it is the likeliest next one.
    assert "chat" in model.preloaded_heads
    assert len(model.preloaded_heads) <= 2
    back = model.swap_head("chat")
    assert back.warm and back.rchar == NO_READ_CALLS
    assert greedy(model) == refs["chat"][1]
    model.auto_preload_heads(0)
    assert model.preloaded_heads == []


def test_cli_build(bundle_case, tmp_path, capsys):
    _, variants, _ = bundle_case
    out = tmp_path / "cli-bundle"
    argv = ["heads", "build", str(variants["base"]), "--head", f"chat={variants['chat']}",
            "--head", f"code={variants['code']}", "--tail", "1", str(out)]
    assert cli_main(argv) == 0
    assert "chat" in capsys.readouterr().out
    assert heads.Bundle(out).names == ["chat", "code"]
    assert cli_main(argv) == 2  # exists
    assert "exists" in capsys.readouterr().err


def test_streaming_options_are_refused_for_bundles(bundle_case):
    out, _, _ = bundle_case
    with pytest.raises(ValueError, match="fully resident"):
        pyloader.load_model(out, resident=0.5)


def test_policy_skips_a_broken_head_and_the_swap_still_succeeds(bundle_case, tmp_path, caplog):
    out, _, refs = bundle_case
    bundle = head_file_copy(out, tmp_path)
    (bundle / "heads" / "base.safetensors").unlink()
    model, _ = pyloader.load_model(bundle, head="chat")
    model.auto_preload_heads(2)  # would preload code and base; base is gone
    assert model.preloaded_heads == ["code"]
    assert "not preloading head 'base'" in caplog.text
    model.swap_head("code")  # committed, and the policy's failure does not undo it
    assert model.current_head == "code" and greedy(model) == refs["code"][1]


def test_bring_in_in_many_chunks(bundle_case, tmp_path, monkeypatch):
    """Reads queued per chunk with the CRC of each chunk overlapping the next
    reads: same result, and a corrupt tensor in a late chunk still refused."""
    out, _, refs = bundle_case
    monkeypatch.setattr(heads.manager, "BRING_IN_CHUNK", 1)  # one tensor per chunk
    model, _ = pyloader.load_model(out, head="chat")
    stats = model.swap_head("code")
    assert stats.populate_bytes == stats.head_bytes
    assert greedy(model) == refs["code"][1]
    bundle = head_file_copy(out, tmp_path)
    victim = heads.Bundle(bundle).head_tensors()[-1]
    corrupt_byte(bundle / "heads" / "base.safetensors", victim)
    model, _ = pyloader.load_model(bundle, head="chat")
    with pytest.raises(heads.HeadChecksumError) as exc:
        model.swap_head("base")
    assert exc.value.tensor == victim
    assert greedy(model) == refs["chat"][1]
