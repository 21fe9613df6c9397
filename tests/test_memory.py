"""Memory behaviour of the readers: zero copy really is zero copy, mappings
and descriptors are released, page hints do what they say."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

import pyloader
from proc_files import require_proc

MEASURE = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    import pyloader

    def status():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
        return out

    path, strategy = sys.argv[1], sys.argv[2]
    # Warm MLX's kernels and thread pools before the baseline.
    mx.eval(mx.max(mx.arange(1 << 16, dtype=mx.float32)))
    before, active0 = status(), mx.get_active_memory()
    arrays = pyloader.load(path, strategy)
    mx.eval([mx.max(a) for a in arrays.values()])  # reads every byte
    after, active1 = status(), mx.get_active_memory()
    print(json.dumps({
        "anon": after["RssAnon"] - before["RssAnon"],
        "file": after["RssFile"] - before["RssFile"],
        "active": active1 - active0,
        "bytes": sum(a.nbytes for a in arrays.values()),
    }))
""")


def measure(path, strategy) -> dict:
    require_proc("/proc/self/status")  # MEASURE reads it in the child
    # cwd away from the source tree, so the child imports the installed package.
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), strategy],
                         capture_output=True, text=True, cwd=os.path.dirname(path))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_mmap_allocates_no_anonymous_memory(large_file):
    m = measure(large_file, "mmap")
    assert m["bytes"] == 64 << 20
    assert m["anon"] < 0.05 * m["bytes"], m
    assert m["active"] < 0.05 * m["bytes"], m
    assert m["file"] > 0.9 * m["bytes"], m  # the bytes were read, through the page cache


def test_pread_control_allocates_the_tensor_bytes(large_file):
    """The same measurement sees the copy a copying reader makes."""
    m = measure(large_file, "pread")
    assert m["anon"] > 0.9 * m["bytes"], m
    assert m["active"] >= m["bytes"], m


def _maps_of(path) -> int:
    require_proc("/proc/self/maps")
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(str(path)))


def _fds() -> int:
    require_proc("/proc/self/fd")
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_no_leaked_mappings_or_descriptors(aligned_file, strategy):
    gc.collect()
    maps0, fds0 = _maps_of(aligned_file), _fds()
    for _ in range(200):
        arrays = pyloader.load(aligned_file, strategy)
        assert arrays["scalar"].item() == 3.5
        del arrays
    gc.collect()
    assert _maps_of(aligned_file) == maps0
    assert _fds() == fds0


def test_mapping_lives_while_an_array_does(aligned_file):
    gc.collect()
    reader = pyloader.MmapReader(aligned_file)
    assert _maps_of(aligned_file) == 0
    x = reader.get("f32")
    assert _maps_of(aligned_file) == 1 and reader.live_mappings == 1
    expected = mx.array(x)  # a copy, for comparison after the reader is gone
    del reader
    gc.collect()
    assert _maps_of(aligned_file) == 1
    assert mx.array_equal(x, expected).item()
    y = x[3:7] * 2  # views and ops on the mapped array keep working
    mx.eval(y)
    del x
    gc.collect()
    assert _maps_of(aligned_file) == 0
    assert y.shape == (4, 512)


def _rss_file() -> int:
    require_proc("/proc/self/status")
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile")


def test_advise_dontneed_and_evict_release_pages(large_file):
    name = "layers.3.w"
    pyloader.evict_file(large_file)
    reader = pyloader.MmapReader(large_file)
    a = reader.get(name)
    assert reader.resident_bytes(name) == 0  # evicted: nothing in the page cache
    rss0 = _rss_file()
    mx.eval(mx.sum(a))
    nbytes = a.nbytes
    assert reader.resident_bytes(name) >= nbytes - 8192
    assert _rss_file() - rss0 > 0.9 * nbytes
    assert reader.advise(name, "dontneed")  # drop from this process
    assert rss0 - 8192 * 2 <= _rss_file() <= rss0 + 0.1 * nbytes
    assert reader.advise(name, "evict")  # and from the page cache
    assert reader.resident_bytes(name) <= 8192
    assert reader.advise(name, "willneed")  # bring it back in ahead of use
    for _ in range(100):
        if reader.resident_bytes(name) >= nbytes - 8192:
            break
        import time
        time.sleep(0.01)
    assert reader.resident_bytes(name) >= nbytes - 8192
    # populate maps the pages into this process now, before any touch.
    assert reader.advise(name, "dontneed")
    rss1 = _rss_file()
    assert reader.advise(name, "populate")
    assert _rss_file() - rss1 > 0.9 * nbytes
    # The data is still right after all of this.
    ref = pyloader.load(large_file, "pread", names=[name])[name]
    assert mx.array_equal(a, ref).item()


def test_advise_rejects_unknown_hint(aligned_file):
    reader = pyloader.MmapReader(aligned_file)
    with pytest.raises(ValueError, match="unknown advice"):
        reader.advise("f32", "yolo")


def test_evict_file_drops_the_page_cache(large_file):
    reader = pyloader.MmapReader(large_file)
    mx.eval([mx.sum(a) for a in reader.load().values()])
    names = pyloader.open(large_file).keys()
    assert sum(reader.resident_bytes(n) for n in names) > 60 << 20
    del reader
    gc.collect()
    pyloader.evict_file(large_file)
    reader = pyloader.MmapReader(large_file)
    assert sum(reader.resident_bytes(n) for n in names) < 1 << 20
