"""Every strategy returns arrays bit-identical to mx.load and safetensors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import pyloader
from pyloader.io.readers import aligned_are_views, zero_copy_mode

from helpers import tensor_bytes, write_raw_safetensors

STRATEGIES = ["mmap", "pread", "mlx"]


def assert_same(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for name, r in ref.items():
        g = got[name]
        assert isinstance(g, mx.array), name
        assert g.dtype == r.dtype, name
        assert g.shape == r.shape, name
        assert tensor_bytes(g) == tensor_bytes(r), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_dtypes_equal_mx_load(all_dtypes_file, strategy):
    assert_same(pyloader.load(all_dtypes_file, strategy), mx.load(str(all_dtypes_file)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_aligned_file_equals_mx_load_and_safetensors(aligned_file, strategy):
    from safetensors.numpy import load_file

    got = pyloader.load(aligned_file, strategy)
    ref_np = load_file(str(aligned_file))
    assert sorted(got) == sorted(ref_np)
    for name, r in ref_np.items():
        g = np.array(got[name])
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert g.tobytes() == r.tobytes(), name
    assert_same(got, mx.load(str(aligned_file)))


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_float64_and_complex64(tmp_path, strategy):
    """Dtypes mx.load rejects still load, equal to the safetensors reference."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(3)
    ref = {"f64": rng.standard_normal((5, 5)),
           "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64)}
    path = tmp_path / "wide.safetensors"
    save_file(ref, str(path))
    got = pyloader.load(path, strategy)
    for name, r in load_file(str(path)).items():
        assert np.array(got[name]).tobytes() == r.tobytes()


def test_aligned_file_is_fully_zero_copy(aligned_file):
    _, stats = pyloader.load_with_stats(aligned_file, "mmap")
    assert stats.zero_copy_mode == zero_copy_mode()
    total = pyloader.open(aligned_file).total_nbytes
    if not aligned_are_views():  # PYLOADER_ZERO_COPY=copy or make_buffer here: copies
        assert stats.copied_bytes == stats.bytes == total and stats.zero_copy_bytes == 0
        assert stats.zero_copy_verified == (stats.zero_copy_mode == "copy")
        return
    assert stats.zero_copy_verified
    assert stats.copied_tensors == 0 and stats.copied_bytes == 0
    assert stats.zero_copy_bytes == stats.bytes == total
    assert stats.zero_copy_fraction == 1.0


def test_mlx_written_file_counts_copies(all_dtypes_file):
    ckpt = pyloader.open(all_dtypes_file)
    misaligned = [t for t in ckpt.tensors() if not t.aligned and t.nbytes]
    assert misaligned, "fixture should contain misaligned tensors"
    _, stats = pyloader.load_with_stats(all_dtypes_file, "mmap")
    copied = misaligned if aligned_are_views() else [t for t in ckpt.tensors() if t.nbytes]
    assert stats.copied_tensors == len(copied)
    assert stats.copied_bytes == sum(t.nbytes for t in copied)
    assert stats.zero_copy_bytes + stats.copied_bytes == ckpt.total_nbytes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_checkpoint(sharded_dir, all_dtypes_file, strategy):
    ckpt = pyloader.open(sharded_dir)
    assert len(ckpt.files) == 3
    assert_same(pyloader.load(sharded_dir, strategy), mx.load(str(all_dtypes_file)))


def test_names_subset_and_unknown_name(aligned_file):
    for strategy in STRATEGIES:
        got = pyloader.load(aligned_file, strategy, names=["f16", "u8"])
        assert sorted(got) == ["f16", "u8"]
        assert pyloader.load(aligned_file, strategy, names=[]) == {}
        with pytest.raises(KeyError, match="nope"):
            pyloader.load(aligned_file, strategy, names=["nope"])


def test_unknown_strategy(aligned_file):
    with pytest.raises(ValueError, match="unknown strategy"):
        pyloader.load(aligned_file, "magic")


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        pyloader.load(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError):
        pyloader.open(tmp_path)  # a directory without safetensors files


def test_misaligned_offsets_hand_made(tmp_path):
    """Tensors placed at offsets that are not multiples of their item size."""
    rng = np.random.default_rng(5)
    f32 = rng.standard_normal(33).astype(np.float32)
    f16 = rng.standard_normal(21).astype(np.float16)
    i64 = rng.integers(-1000, 1000, 5).astype(np.int64)
    tensors = {
        "pad": ("U8", [3], b"\x01\x02\x03"),
        "f32": ("F32", [33], f32.tobytes()),
        "pad2": ("U8", [1], b"\x09"),
        "f16": ("F16", [3, 7], f16.tobytes()),
        "i64": ("I64", [5], i64.tobytes()),
    }
    path = tmp_path / "mis.safetensors"
    for pad in range(8):  # data section at a multiple of 8: offsets set by "pad" tensors
        write_raw_safetensors(path, tensors, header_pad=pad)
        ckpt = pyloader.open(path)
        if ckpt.index.files[0].data_start % 8 == 0:
            break
    assert not ckpt["f32"].aligned and ckpt["f32"].offset % 4 != 0
    ref = mx.load(str(path))
    for strategy in STRATEGIES:
        got = pyloader.load(path, strategy)
        assert_same(got, ref)
        assert np.array_equal(np.array(got["f32"]), f32)
        assert np.array_equal(np.array(got["f16"]), f16.reshape(3, 7))
    # Opt-in views of misaligned tensors give the same bytes without copying (where this
    # MLX makes views at all).
    got, stats = pyloader.load_with_stats(path, "mmap", allow_misaligned=True)
    assert stats.copied_tensors == (0 if aligned_are_views() else len(tensors))
    assert_same(got, ref)


def test_metadata(all_dtypes_file, aligned_file):
    assert pyloader.open(all_dtypes_file).metadata() == {"format": "test", "note": "ünïcode"}
    assert pyloader.open(aligned_file).metadata()["who"] == "safetensors"


def test_checkpoint_table(aligned_file):
    ckpt = pyloader.open(aligned_file)
    t = ckpt["f32"]
    assert (t.dtype, t.shape, t.nbytes) == ("F32", (256, 512), 256 * 512 * 4)
    assert t.file == str(aligned_file)
    with open(aligned_file, "rb") as f:
        f.seek(t.offset)
        raw = f.read(t.nbytes)
    assert raw == np.array(pyloader.load(aligned_file, "pread", names=["f32"])["f32"]).tobytes()
    assert "f32" in ckpt and "zzz" not in ckpt
    assert ckpt.total_nbytes == sum(x.nbytes for x in ckpt.tensors())


@pytest.mark.parametrize("threads,chunk", [(1, 1 << 20), (3, 4096), (8, 12345)])
def test_pread_chunking_and_threads(large_file, threads, chunk):
    reader = pyloader.PreadReader(large_file, threads=threads, chunk_bytes=chunk)
    assert reader.threads == threads
    assert_same(reader.load(), mx.load(str(large_file)))


def test_sub_byte_dtype_is_indexed_but_not_loadable(tmp_path):
    path = tmp_path / "f4.safetensors"
    write_raw_safetensors(path, {"q": ("F4", [4], b"\x12\x34"), "u": ("U8", [1], b"\x05")})
    ckpt = pyloader.open(path)
    assert ckpt["q"].nbytes == 2
    for strategy in ("mmap", "pread"):
        with pytest.raises(pyloader.UnsupportedError, match="F4"):
            pyloader.load(path, strategy)
        assert pyloader.load(path, strategy, names=["u"])["u"].item() == 5


def test_fp8_loads_as_uint8_like_mx_load(tmp_path):
    path = tmp_path / "f8.safetensors"
    write_raw_safetensors(path, {"a": ("F8_E4M3", [3], b"\x01\x80\xff")})
    ref = mx.load(str(path))  # mx.load knows F8_E4M3 only, as raw uint8
    path2 = tmp_path / "f8b.safetensors"
    write_raw_safetensors(path2, {"b": ("F8_E5M2", [2], b"\x10\x20")})
    for strategy in ("mmap", "pread"):
        assert_same(pyloader.load(path, strategy), ref)
        b = pyloader.load(path2, strategy)["b"]
        assert b.dtype == mx.uint8 and tensor_bytes(b) == b"\x10\x20"


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_file_truncated_after_open_raises_oserror(tmp_path, aligned_file, strategy):
    path = tmp_path / "t.safetensors"
    path.write_bytes(aligned_file.read_bytes())
    ckpt = pyloader.open(path)
    with open(path, "r+b") as f:
        f.truncate(ckpt.total_nbytes // 2)
    with pytest.raises(OSError, match="changed on disk since its header was read: trunc") as info:
        pyloader.load(ckpt, strategy)
    assert info.value.filename == str(path)


def test_empty_tensor_name_is_named_in_errors(tmp_path):
    path = tmp_path / "e.safetensors"
    write_raw_safetensors(path, {"": ("F32", [2], b"\0" * 7)})
    with pytest.raises(pyloader.FormatError, match="tensor '': data_offsets"):
        pyloader.open(path)


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_pread_backends_and_background_reads(large_file, backend):
    if backend == "io_uring" and not pyloader.uring_available():
        pytest.skip("io_uring unavailable here: built without liburing or refused by the kernel")
    ref = mx.load(str(large_file))
    reader = pyloader.PreadReader(large_file, chunk_bytes=1 << 20, backend=backend)
    assert reader.backend == backend
    assert_same(reader.load(), ref)
    names = sorted(ref)[:3]
    t1, t2 = reader.submit(names[:2]), reader.submit(names[2:])
    got = reader.take(t2)
    got.update(reader.take(t1))
    assert_same(got, {n: ref[n] for n in names})
    with pytest.raises(ValueError, match="ticket"):
        reader.take(t1)  # a ticket is taken once


def test_uring_is_built_here():
    """CI installs liburing-dev, so the io_uring backend must be compiled in; the
    portable I/O path (PYLOADER_PORTABLE_IO=1, forced in CI) must refuse it."""
    import os

    from pyloader import _core

    if not os.path.exists("/usr/include/liburing.h"):
        pytest.skip("liburing-dev is not installed on this machine")
    if _core.platform()["portable_io"]:
        assert not pyloader.uring_available()
        with pytest.raises(pyloader.UnsupportedError):
            pyloader.PreadReader(pyloader.default_model_path(), backend="io_uring").load()
    else:
        assert pyloader.uring_available()


def test_background_read_error_surfaces_as_oserror(tmp_path, aligned_file):
    path = tmp_path / "t.safetensors"
    path.write_bytes(aligned_file.read_bytes())
    reader = pyloader.PreadReader(path)
    with open(path, "r+b") as f:
        f.truncate(100)
    ticket = reader.submit(["f32"])
    with pytest.raises(OSError, match="changed on disk since its header was read: truncated"):
        reader.take(ticket)


def test_mmap_prefetch_populates(large_file):
    pyloader.evict_file(large_file)
    reader = pyloader.MmapReader(large_file)
    names = ["layers.0.w", "layers.1.w"]
    assert sum(reader.resident_bytes(n) for n in names) < 1 << 20  # evicted
    reader.wait(reader.prefetch(names))
    assert sum(reader.resident_bytes(n) for n in names) >= 2 * (8 << 20)  # page granular
