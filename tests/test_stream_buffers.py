"""The streaming read paths' buffer discipline, which keeps streaming's memory bounded:
pread streams into a few
reusable, pre-committed buffers with O_DIRECT (no page cache filled, none to evict), a
buffer still held is never overwritten; mmap's release and eviction run on the reader's
own threads, ordered before a later request of the same tensors."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model
from models import make_model_dir

import pyloader
from pyloader import _core
from pyloader.io.pagecache import cached_fraction, evict_file, warm
from pyloader.io.readers import MmapReader, PreadReader
from pyloader.streaming import controller_of

PAGE = _core.page_size()  # the kernel's page, or PYLOADER_PAGE_SIZE

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]


def same(got: dict, want: dict) -> bool:
    return all(got[n].dtype == want[n].dtype and mx.array_equal(got[n], want[n]).item()
               for n in got)


def layer_names(reader, layer: int) -> list[str]:
    return [n for n in reader.checkpoint.keys() if n.startswith(f"layers.{layer}.")]


@pytest.fixture()
def reader(large_file):
    evict_file(large_file)
    r = PreadReader(large_file, readahead=False, drop_cache=True, chunk_bytes=1 << 20)
    yield r
    del r
    gc.collect()


def test_reused_buffers_hold_the_checkpoints_bytes(reader, large_file):
    want = mx.load(str(large_file))
    names = layer_names(reader, 0) + layer_names(reader, 1)
    reader.reserve_buffers(2, reader.layout_bytes(names), direct=True)
    assert reader.buffer_slots == 2 and reader.buffers_lent == 0
    for layer in range(8):  # more reads than buffers: each is reused
        got = reader.load(layer_names(reader, layer), reuse=True)
        assert reader.buffers_lent == 1
        assert same(got, want), layer
        del got
        assert reader.buffers_lent == 0  # back as soon as its arrays are gone
    s = reader.stats()
    assert s["buffer_reuses"] == 8 and s["buffer_misses"] == 0


def test_a_held_buffer_is_never_overwritten(reader, large_file):
    want = mx.load(str(large_file))
    names = [layer_names(reader, i) for i in range(4)]
    reader.reserve_buffers(2, reader.layout_bytes(names[0]), direct=True)
    held = [reader.load(names[i], reuse=True) for i in range(3)]  # the third: no slot
    assert reader.buffers_lent == 2
    assert reader.stats()["buffer_misses"] == 1
    assert all(same(arrays, want) for arrays in held)
    del held[0]
    again = reader.load(names[3], reuse=True)  # takes the freed slot
    assert reader.stats()["buffer_reuses"] == 3
    assert all(same(arrays, want) for arrays in held + [again])
    # Without reuse=True a read never takes a slot (resident loads keep theirs).
    reader.load(names[3])
    assert reader.stats()["buffer_reuses"] == 3


def test_direct_reads_leave_no_page_cache(reader, large_file):
    names = layer_names(reader, 2)
    reader.reserve_buffers(1, reader.layout_bytes(names), direct=True)
    assert reader.direct  # ext4 and tmpfs-less test directories allow O_DIRECT here
    evict_file(large_file)
    got = reader.load(names, reuse=True)
    mx.eval(list(got.values()))
    assert reader.stats()["direct_bytes"] >= sum(a.nbytes for a in got.values())
    # Nothing of the file entered the page cache (no readahead, no copy through it).
    assert cached_fraction([large_file]) == 0.0


def test_direct_reads_of_a_misaligned_checkpoint(tmp_path):
    """Tensors at odd offsets (mx.save_safetensors' header): read with O_DIRECT from the
    page holding each one's first byte, placed at the same position within a page."""
    d = make_model_dir(tmp_path / "m", "llama")
    f = d / "model.safetensors"
    want = mx.load(str(f))
    r = PreadReader(d, readahead=False, drop_cache=True)
    assert any(t.offset % PAGE for t in r.checkpoint.tensors())
    names = r.checkpoint.keys()
    r.reserve_buffers(1, r.layout_bytes(names), direct=True)
    got = r.load(names, reuse=True)  # every tensor, the file's last partial page too
    assert r.stats()["buffer_reuses"] == 1
    assert same(got, want)


def test_no_buffers_after_reserving_none(reader):
    names = layer_names(reader, 0)
    reader.reserve_buffers(1, reader.layout_bytes(names), direct=True)
    kept = reader.load(names, reuse=True)
    reader.reserve_buffers(0, 0, direct=True)
    assert reader.buffer_slots == 0
    reader.load(names, reuse=True)
    assert reader.stats()["buffer_reuses"] == 1
    assert all(a.size for a in kept.values())  # arrays keep their dropped buffer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def greedy(model, n=5) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_pread_streaming_reuses_its_buffers(llama, prefetch):
    want = greedy(mlx_lm_load_model(llama)[0])
    f = llama / "model.safetensors"
    model, _ = pyloader.load_model(
        llama, resident=0, tokenizer=False,
        options=pyloader.StreamOptions(strategy="pread", prefetch=prefetch))
    ctl = controller_of(model)
    reader = ctl.reads.reader
    units = len(ctl.layout.units)
    assert reader.buffer_slots == min(prefetch + 1, units) and reader.direct
    evict_file(f)
    assert greedy(model) == want
    s = reader.stats()
    passes = pyloader.stats(model)["passes"]
    # Every streamed unit of every pass went into a reused buffer (prefetch may have
    # read one more ahead).
    assert s["buffer_misses"] == 0
    assert units * passes <= s["buffer_reuses"] <= units * passes + prefetch
    assert s["direct_bytes"] > 0
    del model, ctl
    gc.collect()


def test_pread_keep_page_cache_reads_through_it(llama):
    f = llama / "model.safetensors"
    model, _ = pyloader.load_model(
        llama, resident=0, tokenizer=False,
        options=pyloader.StreamOptions(strategy="pread", keep_page_cache=True))
    reader = controller_of(model).reads.reader
    assert reader.buffer_slots == 2 and not reader.direct
    evict_file(f)
    greedy(model, 2)
    assert reader.stats()["direct_bytes"] == 0 and reader.stats()["buffer_reuses"] > 0
    assert cached_fraction([f]) > 0.5


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Layers of ~1.5 MB: page-level residency checks need more than a few pages."""
    return make_model_dir(tmp_path_factory.mktemp("wide"), "llama", hidden_size=256,
                          intermediate_size=1024, num_attention_heads=4,
                          num_key_value_heads=4)


def test_mmap_release_runs_on_the_reader(wide_llama):
    llama = wide_llama
    f = llama / "model.safetensors"
    model, _ = pyloader.load_model(llama, resident=0, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy="mmap"))
    ctl = controller_of(model)
    want = greedy(mlx_lm_load_model(llama)[0])
    assert greedy(model) == want
    ctl.settle()
    # Every released unit is gone from the process and (not kept) from the page cache,
    # but for what is already requested for the next pass.
    reader = ctl.reads.reader
    assert len(ctl.layout.in_flight) <= 1
    released = resident = 0
    gone = [u for u in ctl.layout.units if u not in ctl.layout.in_flight]
    for unit in gone:
        released += unit.nbytes
        resident += sum(reader.resident_bytes(name) for name in unit.tensor_names)
    # Pages shared with neighbouring tensors (mx.save_safetensors' order interleaves
    # layers; resident tensors and the request in flight keep theirs): at most the edge
    # pages and the one page a small unaligned tensor may fall into whole.
    edges = 3 * PAGE * sum(len(u.tensor_names) for u in ctl.layout.units)
    assert resident <= edges < released / 2, (resident, edges, released)
    size = f.stat().st_size
    # The page cache holds at most what is not released and those pages.
    assert released > 0
    assert cached_fraction([f]) * size <= size - released + edges


def test_mmap_drop_is_ordered_before_a_later_request(large_file):
    """A unit released and requested again at once: the drop runs first, so the
    request's pages stay mapped (the drop never undoes a later populate)."""
    r = MmapReader(large_file)
    name = "layers.3.w"
    nbytes = r.checkpoint[name].nbytes
    for _ in range(20):
        r.wait(r.prefetch([name], "populate"))
        r.drop([name], evict=True)
        t = r.prefetch([name], "populate")
        r.wait(t)
        r.settle()
        # A drop run after the request would leave (almost) nothing. (Not every page:
        # this kernel occasionally reports a few pages of a just-populated range not
        # resident, with the synchronous release of earlier versions too: 1-2 in 3000.)
        assert r.resident_bytes(name) >= nbytes // 2
    r.drop([name], evict=True)
    r.settle()
    assert r.resident_bytes(name) <= 2 * PAGE
    # drop(evict=False) keeps the page cache.
    warm([large_file])
    r.drop([name], evict=False)
    r.settle()
    assert cached_fraction([large_file]) > 0.9
    os.sync()


# ----------------------------------------------------------------------------
# Other allocators' paths, forced in a child process: PYLOADER_BUFFER_OWNER takes
# CUDA's or Metal's path over the CPU allocator, PYLOADER_MAX_BUFFER_LENGTH stands
# in for Metal's maxBufferLength.

RING_CHILD = r"""
import json, sys
import mlx.core as mx
import pyloader
from pyloader import _core
from pyloader.io.pagecache import evict_file
from pyloader.io.readers import PreadReader
path, slots, per_slot = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
want = mx.load(path)
out = {"owner": _core.buffer_owner()}
r = PreadReader(path, readahead=False, drop_cache=True, chunk_bytes=1 << 20)
names = [[n for n in r.checkpoint.keys() if n.startswith(f"layers.{i}.")] for i in range(8)]
try:
    r.reserve_buffers(slots, r.layout_bytes(sum(names[:per_slot], [])), direct=True)
except pyloader.UnsupportedError as e:
    print(json.dumps({**out, "error": str(e)}))
    sys.exit(0)
out.update(direct=r.direct, ring_buffers=r._reader.ring_buffers)
evict_file(path)
same = True
for k in range(0, 8, per_slot):
    got = r.load(sum(names[k:k + per_slot], []), reuse=True)
    same = same and all(mx.array_equal(got[n], want[n]).item() for n in got)
    held = got if k == 0 else None  # one slot stays lent: the next read takes another
s = r.stats()
out.update(same=same, ring_direct_bytes=s["direct_bytes"], reuses=s["buffer_reuses"],
           misses=s["buffer_misses"])
# The eager load too (its cold tensors are read direct where allowed).
evict_file(path)
plain = PreadReader(path)
got = plain.load(names[0])
out.update(load_direct_bytes=plain.stats()["direct_bytes"],
           load_same=all(mx.array_equal(got[n], want[n]).item() for n in got))
print(json.dumps(out))
"""


def ring_child(path, *, owner=None, limit=None, slots=2, per_slot=1) -> dict:
    env = dict(os.environ)
    for k in ("PYLOADER_BUFFER_OWNER", "PYLOADER_MAX_BUFFER_LENGTH", "PYLOADER_ZERO_COPY",
              "PYLOADER_PORTABLE_IO"):
        env.pop(k, None)
    if owner:
        env["PYLOADER_BUFFER_OWNER"] = owner
    if limit:
        env["PYLOADER_MAX_BUFFER_LENGTH"] = str(limit)
    r = subprocess.run([sys.executable, "-c", RING_CHILD, str(path), str(slots), str(per_slot)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("owner", [None, "cuda", "metal"])
def test_no_direct_read_into_memory_the_cpu_allocator_does_not_own(large_file, owner):
    got = ring_child(large_file, owner=owner)
    assert got["owner"] == (owner or "cpu")
    assert got["same"] and got["load_same"] and got["reuses"] == 8 and got["misses"] == 0
    if owner is None:
        # The CPU allocator's buffers: both the ring and a cold load read direct.
        assert got["direct"] and got["ring_direct_bytes"] > 0 and got["load_direct_bytes"] > 0
    else:
        # Managed memory (CUDA), the driver's buffers (Metal): through the page cache.
        assert not got["direct"]
        assert got["ring_direct_bytes"] == 0 and got["load_direct_bytes"] == 0


def slot_bytes(path) -> int:
    """A ring slot for one layer of `path`: its layout, in whole pages."""
    r = PreadReader(path)
    layout = r.layout_bytes([n for n in r.checkpoint.keys() if n.startswith("layers.0.")])
    return -(-layout // PAGE) * PAGE


def test_the_ring_is_split_into_buffers_under_the_largest_buffer(large_file):
    slot = slot_bytes(large_file)  # 8 MiB and a page
    # Room for two slots a buffer (and the page of slack each buffer has).
    got = ring_child(large_file, limit=2 * slot + PAGE, slots=5)
    assert got["ring_buffers"] == 3  # 2 + 2 + 1
    assert got["same"] and got["reuses"] == 8 and got["misses"] == 0
    unsplit = ring_child(large_file, slots=5)
    assert unsplit["ring_buffers"] == 1


def test_a_slot_larger_than_the_largest_buffer_is_refused_with_the_sizes(large_file):
    slot = slot_bytes(large_file)
    got = ring_child(large_file, limit=slot, slots=2)
    assert "error" in got
    assert f"needs {slot + PAGE} bytes" in got["error"]
    assert f"maxBufferLength) is {slot} bytes" in got["error"]
