"""Faults: a checkpoint changed under a streaming model, I/O errors, out of
memory under a cgroup, Ctrl-C. Each scenario runs in a child process
(tests/fault_child.py), so a SIGBUS or a hang fails one test, not pytest.
The figures are in docs/RELIABILITY.md."""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

import pyloader
from cgroup import PYTHON, MemoryCgroup, unavailable_reason
from models import logits, make_model_dir
from moe_models import make_moe_dir
from pyloader.io.readers import aligned_are_views
from pyloader.io.repack import repack

CHILD = Path(__file__).with_name("fault_child.py")
STRATEGIES = ("mmap", "pread")


def child(*args: str, timeout: float = 300, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, (f"child exited {proc.returncode} (negative: killed by signal "
                                  f"{-proc.returncode})\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:  # fault_child.process_resources: no /proc/self here
        pytest.skip(result["skip"])
    return result


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def model_copy(llama, tmp_path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(llama, dst)
    return dst


@pytest.mark.parametrize("how", ["truncate", "grow", "rewrite", "rewrite_keep_mtime", "replace"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_changed_while_streaming(model_copy, strategy, how):
    """Changed after the 4th token: the next read raises OSError(ESTALE) naming the
    file and what changed; every token before it is the reference's. That is the 5th
    token, or the 6th with pread when the model's lone streamed layer was already
    read again (before the change, so from the checkpoint's bytes) for the 5th."""
    r = child("changed", str(model_copy), strategy, how)
    got = r["tokens"]
    assert got == r["reference"][:len(got)]
    assert len(got) == 4 or (strategy == "pread" and len(got) == 5), got
    err = r["error"]
    assert err is not None, "no error: the model went on with a changed file"
    assert err["type"] == "OSError" and err["errno"] == errno.ESTALE
    assert err["filename"] == str(model_copy / "model.safetensors")
    what = {"truncate": ["truncated"],
            # An append updates the modification time before the size (the kernel's
            # write path): a check that lands in between sees the mtime change first.
            "grow": ["grown", "rewritten (modification time changed)"],
            "rewrite": ["rewritten"],
            "rewrite_keep_mtime": ["status-change time changed"], "replace": ["replaced"]}[how]
    assert any(w in err["message"] for w in what), err["message"]
    assert r["pending"] == 0  # the prefetch queue was drained


@pytest.mark.parametrize("strategy,source", [("mmap", "bank"), ("pread", "bank"),
                                             ("mmap", "mmap")])
def test_checkpoint_rewritten_under_an_expert_cache(tmp_path, strategy, source):
    """Expert caches read their experts on every miss (``ExpertReader`` for banks, the
    mapping for ``expert_source="mmap"``): a shard rewritten in place with its
    modification time put back after the 4th token gives ESTALE at the next read, and
    no token before it differs from plain mlx-lm's (expert path)."""
    if source == "mmap" and not aligned_are_views():
        pytest.skip("expert_source='mmap' needs the CPU allocator's views "
                    f"(PYLOADER_ZERO_COPY={os.environ.get('PYLOADER_ZERO_COPY')})")
    path = make_moe_dir(tmp_path / "moe", "qwen3_moe")
    if source == "mmap":  # views need every tensor at a multiple of its item size
        repack(path, tmp_path / "aligned")
        path = tmp_path / "aligned"
    time.sleep(0.05)  # ctime ticks with the kernel's coarse clock
    r = child("changed_experts", str(path), strategy, source)
    got = r["tokens"]
    assert got == r["reference"][:len(got)]
    err = r["error"]
    assert err is not None, f"no error: {len(got)} tokens from a rewritten checkpoint"
    assert err["type"] == "OSError" and err["errno"] == errno.ESTALE, err
    assert err["filename"].startswith(str(path)), err
    assert "status-change time changed" in err["message"], err["message"]


@pytest.mark.parametrize("linked", [False, True], ids=["", "then-hard-linked"])
def test_rewrite_with_restored_mtime_is_caught_by_every_reader(aligned_file, tmp_path, linked):
    """Same size, same inode, other bytes, modification time put back:
    the status-change time (ctime), which no unprivileged call sets back, tells; every
    reader refuses with ESTALE instead of serving the new bytes as the old tensors --
    also when a hard link made afterwards changed the link count (which a deletion
    changes too, and a deletion alone is not a change). (ctime ticks with the kernel's
    coarse clock: a rewrite within a few milliseconds of the header read would not be
    seen; the sleep stands for any real gap.)"""
    path = tmp_path / "a.safetensors"
    shutil.copy(aligned_file, path)
    readers = [pyloader.MmapReader(path), pyloader.PreadReader(path)]
    names = list(readers[0].checkpoint.keys())
    time.sleep(0.05)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-4096:] = bytes(b ^ 0xFF for b in data[-4096:])
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    if linked:
        os.link(path, tmp_path / "another-name.safetensors")
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size
    for r in readers:
        with pytest.raises(OSError) as e:
            r.load(names)
        assert e.value.errno == errno.ESTALE and e.value.filename == str(path)
        assert "status-change time changed" in str(e.value)
    # A new reader sees the new version, without complaint.
    assert pyloader.load(path, "pread")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deleted_files_keep_streaming(model_copy, strategy):
    """The checkpoint's directory removed under a fully streamed model (mlx-lm's tests
    load from a temporary directory and use the model after it is gone): every reader
    holds its files open, so the model keeps computing the same logits."""
    tokens = [1, 7, 42, 3, 99]
    want = logits(mlx_lm_load_model(model_copy)[0], tokens)
    model, _ = pyloader.load_model(model_copy, resident=0, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy=strategy))
    shutil.rmtree(model_copy)
    for _ in range(2):  # every streamed layer read again after the delete
        assert mx.array_equal(logits(model, tokens), want)
    assert pyloader.stats(model)["passes"] >= 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_truncated_at_random_moments_while_generating(model_copy, strategy):
    """20 generations, each with the file truncated at a random moment
    (0-300 ms in, so often in the middle of a forward pass): no signal ever
    kills the child, every trial ends in OSError or completes, and no token
    before the error differs from the reference."""
    r = child("truncate_race", str(model_copy), strategy, "20", "1", timeout=600)
    print(r)
    assert r["errors"] > 0
    assert r["errors"] + r["completed"] == 20
    assert r["wrong_token_trials"] == 0
    assert set(r["errnos"]) <= {str(errno.ESTALE), str(errno.EIO)}


def test_sigbus_guard(tmp_path, big_file):
    """Reading a view whose pages were truncated away gives zeros instead of
    a SIGBUS, and the reader's next check reports the truncation."""
    path = tmp_path / "b.safetensors"
    shutil.copy(big_file, path)
    r = child("sigbus_guard", str(path), "mmap")
    assert r["faults"] >= r["nbytes"] // os.sysconf("SC_PAGE_SIZE") - 1
    assert r["sum"] == 0
    assert r["error"]["errno"] == errno.ESTALE and "truncated" in r["error"]["message"]


def test_without_the_sigbus_guard_the_same_read_kills(tmp_path, big_file):
    """The control: with the guard disabled the same read is a SIGBUS."""
    path = tmp_path / "b.safetensors"
    shutil.copy(big_file, path)
    proc = subprocess.run([sys.executable, str(CHILD), "sigbus_guard", str(path), "mmap"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYLOADER_NO_SIGBUS_GUARD": "1",
                               # Under scripts/sanitize.sh asan: the signal kills the child,
                               # not AddressSanitizer's handler (which aborts).
                               "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "")
                               + ":handle_sigbus=0"})
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_io_error_while_streaming(model_copy, strategy):
    """An injected EIO under a streamed layer: OSError with path and offset,
    the queue drains, no thread is left behind, and once the fault is gone the
    same model generates the reference tokens."""
    r = child("io_error", str(model_copy), strategy)
    err = r["error"]
    assert err["type"] == "OSError" and err["errno"] == errno.EIO
    assert err["filename"] == str(model_copy / "model.safetensors")
    assert r["tensor_offset"] <= err["offset"] < r["tensor_offset"] + r["tensor_nbytes"]
    assert r["pending_after_error"] == 0
    assert r["again"] == r["reference"]
    assert r["threads_after"] == r["threads_before"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_io_error_in_a_plain_load(aligned_file, tmp_path, strategy):
    from pyloader import _core

    path = tmp_path / "a.safetensors"
    path.write_bytes(aligned_file.read_bytes())
    meta = pyloader.open(path)["f32"]
    _core._set_read_fault(str(path), meta.offset + 1000, errno.EIO)
    try:
        with pytest.raises(OSError) as info:
            if strategy == "pread":
                pyloader.load(path, strategy="pread")
            else:
                r = pyloader.MmapReader(path)
                r.wait(r.prefetch(["f32"]))
        assert info.value.errno == errno.EIO and info.value.filename == str(path)
        assert info.value.offset == meta.offset + 1000
    finally:
        _core._clear_read_faults()
    got = pyloader.load(path, strategy=strategy)  # usable again
    assert np.array_equal(np.array(got["f32"]), np.array(pyloader.load(path, "pread")["f32"]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ctrl_c_during_streamed_generation(model_copy, strategy):
    r = child("interrupt_generation", str(model_copy), strategy)
    print(r)
    assert r["interrupted"] and r["tokens"] > 0
    assert r["latency_s"] < 1.0
    assert r["during"]["threads"] > r["base"]["threads"]  # the model had its own threads
    # Dropping the interrupted model releases its descriptors, mappings and threads.
    assert r["after"] == r["base"]


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    """256 MiB of float32, enough for a load to take a while from a cold cache."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    save_file({f"w{i}": np.full((2048, 4096), i, np.float32) for i in range(8)}, str(path))
    return path


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ctrl_c_during_a_long_load(big_file, strategy):
    r = child("interrupt_load", str(big_file), strategy)
    print(r)
    assert r["interrupted"]
    # pread checks for Ctrl-C every 20 ms and stops within a 16 MiB chunk per
    # thread; a whole cold load of the file takes longer than this bound.
    assert r["latency_s"] < 0.5
    assert r["after"] == r["base"]


CG_REASON = unavailable_reason()

OOM_CHILD = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    import pyloader
    out = {}
    try:
        arrays = pyloader.load(sys.argv[1], strategy=sys.argv[2])
        out["values"] = {k: [mx.min(a).item(), mx.max(a).item()] for k, a in arrays.items()}
        out["tensors"] = len(arrays)
    except MemoryError as e:
        out["error"] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.skipif(CG_REASON is not None, reason=f"memory cgroup: {CG_REASON}")
def test_out_of_memory_under_a_cgroup_is_a_clean_error(big_file):
    """A pread load of 256 MiB under a 160 MB cgroup: MemoryError before any
    allocation (without the check the kernel kills the child half way). The
    zero-copy mmap load of the same file fits and is whole."""
    limit = 160 * 10**6
    with MemoryCgroup(limit) as cg:
        r = cg.run([PYTHON, "-c", OOM_CHILD, str(big_file), "pread"], timeout=300,
                   cwd=str(big_file.parent))
        assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
        out = json.loads(r.stdout)
        assert "error" in out and "tensors" not in out
        assert str(big_file) in out["error"] and "nothing was loaded" in out["error"]
        assert cg.read("memory.max_usage_in_bytes") < limit
    with MemoryCgroup(limit) as cg:
        r = cg.run([PYTHON, "-c", OOM_CHILD, str(big_file), "mmap"], timeout=300,
                   cwd=str(big_file.parent))
        assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
        out = json.loads(r.stdout)
        assert out["tensors"] == 8
        assert out["values"] == {f"w{i}": [i, i] for i in range(8)}


def test_memory_check_refuses_more_than_available(monkeypatch, aligned_file):
    from pyloader._util.memory import MemorySnapshot
    from pyloader.io import strategies as load_module

    monkeypatch.setattr(load_module, "read_memory",
                        lambda: MemorySnapshot(time=0.0, mem_available=1000))
    with pytest.raises(MemoryError, match="nothing was loaded"):
        pyloader.load(aligned_file, strategy="pread")
    assert os.path.exists(aligned_file)
    monkeypatch.setattr(load_module, "read_memory",
                        lambda: MemorySnapshot(time=0.0, mem_available=1 << 40))
    assert len(pyloader.load(aligned_file, strategy="pread")) == len(pyloader.open(aligned_file))


def _interrupt_at(k: int, op) -> bool:
    """Run ``op`` with a KeyboardInterrupt raised at its ``k``-th step where Python checks for
    Ctrl-C (a Python function's entry or exit, a C function's return); True when ``op``
    finished before it. A KeyboardInterrupt ``op`` swallows fails the test."""
    seen = [0]

    def profile(frame, event, arg):
        if event in ("call", "return", "c_return"):
            seen[0] += 1
            if seen[0] == k:
                sys.setprofile(None)
                raise KeyboardInterrupt(f"step {k}")

    sys.setprofile(profile)
    try:
        op()
    except KeyboardInterrupt:
        return False
    finally:
        sys.setprofile(None)
    assert seen[0] < k, f"the KeyboardInterrupt at step {k} was swallowed"
    return True


def _open_resources(root: Path) -> tuple[int, int]:
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        return fds, sum(1 for line in f if str(root) in line)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
# A file object dropped by the interrupt is closed as it goes, with CPython's ResourceWarning.
@pytest.mark.filterwarnings("ignore::ResourceWarning",
                            "ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("what", ["safetensors mmap", "safetensors pread", "gguf mmap",
                                  "config.json"])
def test_ctrl_c_after_any_step_leaves_nothing_open(tmp_path, aligned_file, what):
    """A Ctrl-C lands where Python checks for it: after any C call returns (os.open's, too)
    or at any function's entry or exit. Raised at each such step of a load in turn, it
    leaves no descriptor or mapping of the files behind, and it is never swallowed."""
    from gguf_inplace_files import write_model

    from pyloader.io.config import read_config_file

    if what.startswith("gguf"):
        path = tmp_path / "m.gguf"
        write_model(path, "llama", "Q4_0", sizes={"n_layer": 1},
                    tokenizer={"tokenizer.ggml.model": "none"})
    else:
        path = tmp_path / "a.safetensors"
        shutil.copy(aligned_file, path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')

    def op():
        if what == "config.json":
            read_config_file(tmp_path / "config.json")
            return
        arrays = pyloader.load(path, strategy=what.split()[1])
        mx.eval(list(arrays.values()))

    base = _open_resources(tmp_path)
    k = 1
    while not _interrupt_at(k, op):
        if _open_resources(tmp_path) != base:  # or only not yet collected
            gc.collect()
            assert _open_resources(tmp_path) == base, f"{what}: left open by a Ctrl-C at step {k}"
        k += 1
    assert k > 5, k  # the steps were reached
