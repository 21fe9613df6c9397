"""Arrays that MLX owns on every backend (so MLX's allocator, not pyloader, decides when
memory goes).

* The make_buffer path's arithmetic (``_core.page_span`` / ``_core.released_bytes``,
  pure functions) at 4 KiB and 16 KiB pages: the spans Metal would wrap, the array's
  offset in them, neighbours sharing a page, what a release gives back.
* The rule ``PYLOADER_ZERO_COPY`` applies per allocator (``_core.parse_zero_copy``).
* Every path a user can force with ``PYLOADER_ZERO_COPY`` (the copy CUDA gets; the
  ``make_buffer``-returned-null branch, which MLX's CPU allocator takes) runs here, in a
  child process started with that variable, and gives arrays and greedy tokens
  bit-identical to plain ``mx.load`` + mlx-lm: a load, a streamed model (mmap and pread),
  the preallocated KV cache and the expert bank; the stats say copies, not views.
* Streaming holds at most the resident set plus the units in flight in MLX's memory
  under every mode (on Metal ``make_buffer`` adds each wrapped buffer
  to MLX's residency set, counted in ``mx.get_active_memory()``), measured in a child
  (tests/streamed_memory_child.py) at resident=0 and resident=1.0.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model
from models import make_model_dir
from moe_models import make_moe_dir

import pyloader
from pyloader._native import core
from pyloader.io.repack import repack
from pyloader.io.readers import zero_copy_mode

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import zero_copy_child as child  # noqa: E402

KiB = 1024

# ----------------------------------------------------------------------------
# page_span: (begin, length, offset) of the whole pages make_buffer wraps


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB])
def test_span_of_a_tensor_at_a_page_start(page):
    assert core.page_span(0, 10 * page, 2 * page, 100, page) == (2 * page, page, 0)
    # Exactly one page long: still one page.
    assert core.page_span(0, 10 * page, 2 * page, page, page) == (2 * page, page, 0)


def test_span_depends_on_the_page_size():
    # Bytes [5000, 15000): pages 1-3 at 4 KiB, page 0 at 16 KiB.
    assert core.page_span(0, 1 << 20, 5000, 10000, 4096) == (4096, 12288, 904)
    assert core.page_span(0, 1 << 20, 5000, 10000, 16384) == (0, 16384, 5000)
    # Bytes [20000, 20010): page 4 at 4 KiB, page 1 at 16 KiB.
    assert core.page_span(0, 1 << 20, 20000, 10, 4096) == (16384, 4096, 3616)
    assert core.page_span(0, 1 << 20, 20000, 10, 16384) == (16384, 16384, 3616)


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB])
def test_span_of_a_tensor_straddling_pages(page):
    # 16 bytes across the first page boundary: two pages, the tensor 8 bytes before the end.
    assert core.page_span(0, 10 * page, page - 8, 16, page) == (0, 2 * page, page - 8)
    # Over three pages from inside the second.
    assert core.page_span(0, 10 * page, page + 1, 2 * page, page) == (page, 3 * page, 1)


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB])
def test_neighbours_sharing_a_page(page):
    a = core.page_span(0, 10 * page, page + 100, 200, page)          # [p+100, p+300)
    b = core.page_span(0, 10 * page, page + 300, 2 * page - 295, page)  # [p+300, 3p+5)
    assert a == (page, page, 100)
    assert b == (page, 3 * page, 300)
    # MLX counts each buffer's whole length: 4 pages live for 3 distinct ones.
    assert a[1] + b[1] == 4 * page
    # Releasing a while b lives gives nothing back (its page is b's first); releasing b
    # while a lives gives back b's two pages of its own; the last one frees all it has.
    assert core.released_bytes(a, [b]) == 0
    assert core.released_bytes(b, [a]) == 2 * page
    assert core.released_bytes(a, []) == page
    assert core.released_bytes(b, []) == 3 * page
    # A third buffer beside them, sharing nothing, changes nothing.
    c = core.page_span(0, 10 * page, 5 * page, 10, page)
    assert core.released_bytes(b, [a, c]) == 2 * page
    # Overlapping live spans are not counted twice.
    assert core.released_bytes(b, [a, a, (page, 2 * page, 0)]) == page


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB])
def test_zero_byte_tensor_wraps_nothing(page):
    span = core.page_span(0, 10 * page, 3 * page + 7, 0, page)
    assert span == (3 * page + 7, 0, 0)
    assert core.released_bytes(span, []) == 0
    # Even at the very end of the region.
    assert core.page_span(0, 10 * page, 10 * page, 0, page) == (10 * page, 0, 0)


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB])
def test_tensor_at_the_end_of_the_file(page):
    size = 9 * page + 123  # the file ends 123 bytes into its last page
    # The last tensor's span runs to the end of the mapping's last (whole) page.
    assert core.page_span(0, size, 9 * page - 7, 130, page) == (8 * page, 2 * page, page - 7)
    # A file that ends on a page boundary: the span ends with it.
    assert core.page_span(0, 9 * page, 8 * page + 1, page - 1, page) == (8 * page, page, 1)
    # One byte past the end is not a tensor of this region.
    assert core.page_span(0, size, 9 * page - 7, 131, page) is None


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB])
def test_spans_that_cannot_be_wrapped(page):
    assert core.page_span(page // 2, 10 * page, 0, 8, page) is None  # region off a page
    assert core.page_span(3 * page, 10 * page, 0, 8, page) == (0, page, 0)
    assert core.page_span(0, 10 * page, 11 * page, 1, page) is None  # outside
    assert core.page_span(0, 10 * page, 0, 8, page + 1) is None  # not a power of two
    assert core.page_span(0, 10 * page, 0, 8, 0) is None


# ----------------------------------------------------------------------------
# The PYLOADER_ZERO_COPY rule


def test_auto_chooses_by_who_owns_the_buffers():
    assert core.parse_zero_copy("", "cpu") == "header"
    assert core.parse_zero_copy("auto", "cpu") == "header"
    assert core.parse_zero_copy("auto", "metal") == "make_buffer"
    assert core.parse_zero_copy("", "cuda") == "copy"
    for owner in ("cpu", "metal", "cuda"):
        assert core.parse_zero_copy("copy", owner) == "copy"
        assert core.parse_zero_copy("make_buffer", owner) == "make_buffer"


def test_header_is_refused_where_buffers_are_not_the_cpu_allocators():
    assert core.parse_zero_copy("header", "cpu") == "header"
    for owner in ("metal", "cuda"):
        with pytest.raises(pyloader.UnsupportedError, match=f"header.*{owner}"):
            core.parse_zero_copy("header", owner)


def test_unknown_values_are_refused():
    with pytest.raises(ValueError, match="'mmap' is not one of auto, header"):
        core.parse_zero_copy("mmap", "cpu")
    with pytest.raises(ValueError, match="unknown buffer owner"):
        core.parse_zero_copy("auto", "rocm")


def test_this_process_runs_mlxs_cpu_allocator():
    # The MLX this project installs on Linux is mlx-cpu; the metal/cuda lines of the
    # rule above run only in CI on those machines.
    assert core.buffer_owner() == "cpu"
    assert zero_copy_mode() == core.parse_zero_copy(
        os.environ.get("PYLOADER_ZERO_COPY", ""), "cpu")


def run_child(mode: str | None, *args, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYLOADER_ZERO_COPY", None)
    if mode is not None:
        env["PYLOADER_ZERO_COPY"] = mode
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def test_a_bad_setting_fails_every_load_with_its_name(aligned_file):
    code = ("import pyloader, sys\n"
            "for _ in range(2):\n"
            "    try:\n"
            f"        pyloader.load({str(aligned_file)!r}, strategy='mmap')\n"
            "    except ValueError as e:\n"
            "        print('refused:', e)\n"
            "print(len(pyloader.load(sys.argv[1], strategy='pread')))\n")
    r = run_child("zero", "-c", code, str(aligned_file))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == ["refused: PYLOADER_ZERO_COPY='zero' is not one of auto, header, "
                         "make_buffer, copy"] * 2
    assert int(lines[2]) > 0  # pread does not depend on it


# ----------------------------------------------------------------------------
# Every mode, end to end (child processes)

MODES = [None, "header", "copy", "make_buffer"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(dense, moe): an aligned llama and an aligned qwen3_moe (every tensor a view
    candidate), with plain mx.load's digests and mlx-lm's greedy tokens."""
    root = tmp_path_factory.mktemp("zero_copy")
    dense = root / "dense"
    repack(make_model_dir(root / "dense_src", "llama"), dense)
    moe = root / "moe"
    repack(make_moe_dir(root / "moe_src", "qwen3_moe"), moe)
    want = {"load": {n: child.digest(a) for n, a in
                     mx.load(str(dense / "model.safetensors")).items()},
            "dense": child.greedy(mlx_lm_load_model(dense)[0]),
            "moe": child.greedy(mlx_lm_load_model(moe)[0])}
    return dense, moe, want


@pytest.fixture(scope="module")
def runs(models):
    dense, moe, _ = models
    out = {}
    for mode in MODES:
        r = run_child(mode, str(HERE / "zero_copy_child.py"), str(dense), str(moe))
        assert r.returncode == 0, f"PYLOADER_ZERO_COPY={mode}: {r.stderr[-3000:]}"
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("mode", MODES)
def test_load_is_bit_identical_in_every_mode(models, runs, mode):
    _, _, want = models
    got = runs[mode]["load"]
    assert got["digests"] == want["load"]
    s = got["stats"]
    expected = {None: "header", "header": "header", "copy": "copy",
                "make_buffer": "make_buffer"}[mode]
    assert runs[mode]["mode"] == s["zero_copy_mode"] == expected
    assert s["tensors"] == len(want["load"])
    if expected == "header":
        assert s["zero_copy_tensors"] == s["tensors"] and s["copied_tensors"] == 0
        assert s["zero_copy_verified"]
    else:
        # The copy CUDA gets, or make_buffer returning null on MLX's CPU allocator.
        assert s["copied_tensors"] == s["tensors"] and s["zero_copy_tensors"] == 0
        assert s["zero_copy_verified"] == (expected == "copy")


@pytest.mark.parametrize("mode", MODES)
def test_streamed_model_is_bit_identical_in_every_mode(models, runs, mode):
    _, _, want = models
    got = runs[mode]
    for strategy in ("stream_mmap", "stream_pread"):
        assert got[strategy]["tokens"] == want["dense"], strategy
    mmap = got["stream_mmap"]["stats"]
    assert mmap["zero_copy_mode"] == got["mode"]
    if got["mode"] == "header":
        assert mmap["copied_tensors"] == 0 and mmap["zero_copy_tensors"] > 0
    else:
        # Streamed tensors are attached per use and dropped at release (a copy, or a view
        # that holds memory, is never kept between passes): more copies than the
        # checkpoint has tensors.
        assert mmap["zero_copy_bytes"] == 0
        assert mmap["copied_tensors"] > len(want["load"])
    pread = got["stream_pread"]["stats"]
    assert pread["buffer_reuses"] > 0 and pread["buffer_misses"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_kv_cache_and_expert_bank_are_bit_identical_in_every_mode(models, runs, mode):
    _, _, want = models
    got = runs[mode]
    assert got["kv"]["tokens"] == want["dense"]
    offsets = set(got["kv"]["offsets"])  # every layer wrote the prompt and the tokens
    assert len(offsets) == 1 and offsets.pop() >= len(child.PROMPT) + child.N_TOKENS - 1
    assert got["experts_bank"]["tokens"] == want["moe"]


@pytest.mark.parametrize("mode", MODES)
def test_page_cache_experts_need_views_that_cost_nothing(models, runs, mode):
    _, _, want = models
    got = runs[mode]["experts_mmap"]
    if runs[mode]["mode"] == "header":
        assert got == {"tokens": want["moe"]}
    else:
        assert "expert_source='bank'" in got["error"]
        assert runs[mode]["mode"] in got["error"]


def test_digest_sees_every_byte():
    a = mx.arange(16, dtype=mx.uint8)
    b = mx.concatenate([a[:15], mx.array([200], dtype=mx.uint8)])
    assert child.digest(a) != child.digest(b)
    assert child.digest(a) == "mlx.core.uint8(16,):" + hashlib.sha256(bytes(range(16))).hexdigest()


# ----------------------------------------------------------------------------
# Streaming holds at most the resident set plus the units in flight

MiB = 1 << 20


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """An aligned 8-layer llama of 60.5 MiB, 7.5 MiB a layer: the units dwarf the
    activations, so holding one unit too many shows."""
    root = tmp_path_factory.mktemp("streamed_memory")
    out = root / "dense"
    repack(make_model_dir(root / "src", "llama", hidden_size=512, intermediate_size=2048,
                          num_hidden_layers=8, vocab_size=256), out)
    return out


def memory_run(mode: str | None, model: Path, *flags: str) -> dict:
    r = run_child(mode, str(HERE / "streamed_memory_child.py"), str(model), *flags)
    assert r.returncode == 0, f"PYLOADER_ZERO_COPY={mode}: {r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def streaming_bound(run: dict) -> int:
    """What a resident=0 model may hold at its peak: the non-layer weights, the unit
    computing and the ``depth`` units requested ahead of it (each at most the largest
    unit), and the activations: what the same generation adds to the fully resident
    model's weights (peak - active after the load at resident=1.0; 2.8 MiB here) plus
    1 MiB."""
    s, r = run["streamed"], run["resident"]
    activations = r["peak"] - r["active_after_load"]
    return (s["non_layer_bytes"] + (s["depth"] + 1) * s["largest_unit"]
            + activations + MiB)


@pytest.mark.parametrize("mode", [None, "copy", "make_buffer"])
def test_streaming_holds_at_most_the_resident_set_and_the_units_in_flight(wide_llama, mode):
    run = memory_run(mode, wide_llama)
    s, r = run["streamed"], run["resident"]
    if mode is not None:
        assert run["mode"] == mode
    assert s["tokens"] == r["tokens"]
    assert s["streamed_units"] == 8 and s["depth"] == 1 and r["streamed_units"] == 0
    bound = streaming_bound(run)
    # The bound means something: well under the weights (about 19 MiB of 60.5 here).
    assert bound < run["weight_bytes"] / 2
    assert s["peak"] <= bound, (s["peak"] / MiB, bound / MiB)
    assert max(s["active"]) <= bound
    if run["mode"] == "header":
        # The CPU allocator's views are no allocation: the weights count nowhere, streamed
        # or resident (measured: 2.8 MiB peaks both).
        assert r["active_after_load"] < run["weight_bytes"] / 8
    else:
        # Copies (CUDA; make_buffer's null branch here) and Metal's wrapped buffers count:
        # the resident model holds all its weights (63 MiB peak), the streamed one about
        # one unit and the activations (10.7 MiB).
        assert r["active_after_load"] >= run["weight_bytes"]
        assert s["peak"] < r["peak"] / 2, (s["peak"] / MiB, r["peak"] / MiB)


def test_the_bound_catches_units_that_are_never_released(wide_llama):
    """With the mmap reads' release doing nothing, every unit stays attached until it
    is brought in again: the streamed model holds all its weights (70 MiB peak) and the
    bound above fails."""
    run = memory_run("copy", wide_llama, "--never-release")
    assert run["streamed"]["tokens"] == run["resident"]["tokens"]
    assert run["streamed"]["peak"] > streaming_bound(run)
    assert run["streamed"]["peak"] >= run["weight_bytes"]


# ----------------------------------------------------------------------------
# The make_buffer path's limits, forced on Linux


@pytest.mark.parametrize("page", [16 * KiB, 64 * KiB])
def test_span_stops_at_the_mapping_when_the_page_exceeds_the_kernels(page):
    # PYLOADER_PAGE_SIZE above the kernel's 4 KiB page: the mapping of a file ending 123
    # bytes into its last page ends at the next 4 KiB, not at the next `page`.
    size = 9 * page + 123
    span = core.page_span(0, size, 9 * page - 7, 130, page, kernel_page=4 * KiB)
    assert span == (8 * page, page + 4 * KiB, page - 7)
    # Inside the file nothing changes.
    assert core.page_span(0, size, page + 1, 10, page, kernel_page=4 * KiB) == (page, page, 1)


def misaligned_file(path: Path) -> Path:
    """Two float32 tensors, both at file offsets of 2 mod 4 (the header's length)."""
    header = {"a": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]},
              "b": {"dtype": "F32", "shape": [2, 1024], "data_offsets": [4096, 12288]}}
    text = json.dumps(header).encode()
    text += b" " * ((2 - 8 - len(text)) % 4)  # 8 + len(text) == 2 (mod 4)
    data = bytes(range(256)) * 48
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


MMAP_CHILD = r"""
import json, os, sys
import mlx.core as mx
import pyloader
from pyloader._native import core
from pyloader.io.readers import MmapReader
path = sys.argv[1]
r = MmapReader(path, allow_misaligned=True)
got = r.load()
mx.eval(list(got.values()))
want = mx.load(path)
bits = lambda a: a.view(mx.uint32)  # bytes, NaNs included
out = {"mode": core.zero_copy_mode(),
       "same": all(mx.array_equal(bits(got[n]), bits(want[n])).item() for n in want)}
out["stats"] = r._reader.stats()
r._reader.drop(list(want), False)
r._reader.settle()
out["remaps"] = core._remap_releases()
real = os.path.realpath(path)
out["perms"] = sorted({line.split()[1] for line in open("/proc/self/maps")
                       if line.rstrip().endswith(real)})
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["header", "make_buffer", "copy"])
def test_misaligned_tensors_are_views_only_where_the_cpu_reads_them(tmp_path, mode):
    """allow_misaligned hands out views in the header mode only: a make_buffer view's
    offset is what Metal binds a kernel's buffer at, which must be a multiple of the
    element. Under make_buffer the tensors are copied without a view being tried (one
    would count as refused: zero_copy_verified False)."""
    f = misaligned_file(tmp_path / "odd.safetensors")
    env = dict(os.environ, PYLOADER_DROP="remap")
    env["PYLOADER_ZERO_COPY"] = mode
    r = subprocess.run([sys.executable, "-c", MMAP_CHILD, str(f)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    s = got["stats"]
    assert got["mode"] == mode and got["same"] and s["tensors"] == 2
    if mode == "header":
        assert s["zero_copy_tensors"] == 2 and s["copied_tensors"] == 0
    else:
        assert s["copied_tensors"] == 2 and s["zero_copy_tensors"] == 0
        assert s["zero_copy_verified"]


@pytest.mark.parametrize("mode", ["header", "make_buffer", "copy"])
def test_mappings_are_read_only_unless_the_cpu_may_write_through_them(tmp_path, mode):
    """A file's mapping is writable (private: copy on write) only for the CPU
    allocator's views, which NumPy may write through. A release by remapping (XNU's,
    forced here) keeps the protection: a read-only mapping stays read-only."""
    f = misaligned_file(tmp_path / "odd.safetensors")
    env = dict(os.environ, PYLOADER_DROP="remap", PYLOADER_ZERO_COPY=mode)
    r = subprocess.run([sys.executable, "-c", MMAP_CHILD, str(f)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["remaps"] > 0  # the release remapped part of the mapping
    assert got["perms"] == (["rw-p"] if mode == "header" else ["r--p"])


def test_a_release_waits_for_the_wrapped_buffers_over_its_bytes():
    """The rule the mmap reader's releases follow while make_buffer views live (views
    MLX's CPU allocator never makes, so a hook drives it with byte ranges): a release
    sharing a byte with a live view runs when the last such view is gone."""
    v = core._ViewedRanges()
    a = v.view(0, 100)
    b = v.view(50, 300)
    assert v.release(300, 400)  # shares nothing: now
    assert not v.release(0, 60)  # under a and b
    assert not v.release(200, 250)  # under b
    assert v.released == [(300, 400)] and v.waiting == 2
    a.close()
    assert v.released == [(300, 400)]  # b still shows [50, 60) and [200, 250)
    b.close()
    assert v.released == [(300, 400), (0, 60), (200, 250)]
    assert v.live == 0 and v.waiting == 0


OWNER_CHILD = ("import pyloader\nfrom pyloader._native import core\n"
               "print(core.buffer_owner(), core.zero_copy_mode())")


@pytest.mark.parametrize("value,want", [("", "cpu header"), ("auto", "cpu header"),
                                        ("cpu", "cpu header"), ("cuda", "cuda copy"),
                                        ("metal", "metal make_buffer")])
def test_another_allocators_path_can_be_forced(value, want):
    env = {k: v for k, v in os.environ.items() if k != "PYLOADER_ZERO_COPY"}
    env["PYLOADER_BUFFER_OWNER"] = value
    r = subprocess.run([sys.executable, "-c", OWNER_CHILD], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[0] == want


def test_an_unknown_owner_is_refused_with_its_name():
    env = dict(os.environ, PYLOADER_BUFFER_OWNER="rocm")
    r = subprocess.run([sys.executable, "-c", OWNER_CHILD], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "PYLOADER_BUFFER_OWNER='rocm' is not one of auto, cpu, metal, cuda" in r.stderr
