"""Aligned repack and ``pyloader.save_safetensors``: still a safetensors file for every
reader, every tensor zero-copy (natural layout: on its dtype's boundary with nothing
added; page layout: on the boundary, padding hidden by pyloader), identical tensors
through pyloader, safetensors and mx.load, written atomically (in place: per shard)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from safetensors import deserialize

import pyloader
from helpers import tensor_bytes, write_raw_safetensors
from models import make_model_dir
from pyloader.io import writer
from pyloader.cli import main as cli_main
from pyloader.io.checkpoint import ITEMSIZE
from pyloader.io.repack import repack, repack_in_place

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]


def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every entry of a file as the safetensors library reads it."""
    return {n: (t["dtype"], t["shape"], bytes(t["data"]))
            for n, t in deserialize(path.read_bytes())}


def check_aligned(path: Path, align: int | None) -> None:
    """Every tensor on ``align`` (None: on its dtype's size, with no padding entries), the
    data section on ``align`` (None: 16 KiB), the header padded with spaces."""
    ckpt = pyloader.open(path)
    assert len(ckpt) > 0
    for t in ckpt.tensors():
        assert t.aligned, t.name
        assert t.offset % (align or ITEMSIZE[t.dtype]) == 0, (t.name, t.offset)
    if align is None:
        assert not ckpt.padding_names
    for f in ckpt.index.files:
        assert f.data_start % (align or 16384) == 0
        header = Path(f.path).read_bytes()[8:f.data_start]
        assert header.rstrip(b" ").endswith(b"}")  # padded with JSON whitespace


@pytest.mark.parametrize("align", [64, 16384])
def test_every_dtype_round_trips(all_dtypes_file, tmp_path, align):
    dst = tmp_path / "out.safetensors"
    result = repack(all_dtypes_file, dst, align=align)
    src_ck, dst_ck = pyloader.open(all_dtypes_file), pyloader.open(dst)
    assert sorted(dst_ck.keys()) == sorted(src_ck.keys())
    assert result.tensors == len(src_ck) and result.pad_entries == len(dst_ck.padding_names)
    assert dst_ck.metadata()["note"] == "ünïcode" and dst_ck.metadata()["pyloader.align"] == str(align)
    check_aligned(dst, align)

    ref = mx.load(str(all_dtypes_file))
    by_mlx = mx.load(str(dst))
    by_st = raw_tensors(dst)
    ours, stats = pyloader.load_with_stats(dst, "mmap")
    assert set(ours) == set(ref)
    for name, arr in ref.items():
        want = tensor_bytes(arr)
        assert tensor_bytes(ours[name]) == want, name
        assert tensor_bytes(by_mlx[name]) == want, name
        assert ours[name].dtype == arr.dtype and ours[name].shape == arr.shape
        dtype, shape, data = by_st[name]
        assert (dtype, shape, data) == (src_ck[name].dtype, list(arr.shape), want), name
    # Other readers see the padding as small uint8 tensors; pyloader does not.
    pads = set(by_mlx) - set(ref)
    assert pads == set(dst_ck.padding_names) and pads
    assert all(by_mlx[p].dtype == mx.uint8 and by_mlx[p].ndim == 1 for p in pads)
    # Every tensor is a zero-copy view after the repack (before: many copies).
    assert stats.copied_tensors == 0 and stats.zero_copy_tensors == len(ref)
    _, before = pyloader.load_with_stats(all_dtypes_file, "mmap")
    assert before.copied_tensors > 0


def test_padding_hidden_everywhere(all_dtypes_file, tmp_path):
    dst = tmp_path / "out.safetensors"
    repack(all_dtypes_file, dst, align=4096)
    ck = pyloader.open(dst)
    pad = sorted(ck.padding_names)[0]
    assert pad not in ck and pad not in ck.keys()
    with pytest.raises(KeyError):
        ck[pad]
    with pytest.raises(KeyError):
        pyloader.load(dst, names=[pad])
    for strategy in pyloader.STRATEGIES:
        assert pad not in pyloader.load(dst, strategy)
    assert pad not in pyloader.MmapReader(dst).load()
    assert pad not in pyloader.PreadReader(dst).load()
    assert ck.total_nbytes == pyloader.open(all_dtypes_file).total_nbytes
    assert ck.alignment_summary()["aligned_tensors"] == len(ck)


def test_pad_like_name_in_an_ordinary_file_is_a_tensor(tmp_path):
    path = tmp_path / "plain.safetensors"
    write_raw_safetensors(path, {"__pyloader_pad_0_0": ("U8", [3], b"abc")})
    ck = pyloader.open(path)
    assert "__pyloader_pad_0_0" in ck and not ck.padding_names
    assert tensor_bytes(pyloader.load(path)["__pyloader_pad_0_0"]) == b"abc"


def test_repack_of_repack_is_stable(all_dtypes_file, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    repack(all_dtypes_file, a, align=256)
    repack(a, b, align=256)
    assert a.read_bytes() == b.read_bytes()


def test_sharded_checkpoint_gets_a_new_index(sharded_dir, tmp_path):
    dst = tmp_path / "sharded"
    repack(sharded_dir, dst, align=1024)
    shards = sorted(p.name for p in sharded_dir.glob("*.safetensors"))
    assert sorted(p.name for p in dst.glob("*.safetensors")) == shards
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    ck = pyloader.open(dst)  # the index and the shards must agree both ways
    assert set(index["weight_map"]) == set(ck.index.keys())
    assert set(ck.padding_names) <= set(index["weight_map"]) and ck.padding_names
    check_aligned(dst, 1024)
    ref = pyloader.load(sharded_dir, "mlx")
    got = pyloader.load(dst)
    assert set(got) == set(ref)
    for n in ref:
        assert tensor_bytes(got[n]) == tensor_bytes(ref[n]), n
    for shard in shards:  # each shard holds the same tensors as before
        src_names = set(pyloader.open(sharded_dir / shard).keys())
        assert set(pyloader.open(dst / shard).keys()) == src_names


@pytest.mark.parametrize("arch,bits", [("llama", 4), ("qwen3", 4), ("qwen2", None)])
def test_model_round_trip(tmp_path, arch, bits):
    src = make_model_dir(tmp_path / "src", arch, dtype=mx.bfloat16, bits=bits)
    (src / "README.md").write_text("a model card")
    dst = tmp_path / "dst"
    result = repack(src, dst)
    assert sorted(result.copied_files) == ["README.md", "config.json"]
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    check_aligned(dst, None)
    weights, stats = pyloader.load_with_stats(dst)
    assert stats.copied_tensors == 0 and stats.zero_copy_bytes == stats.bytes
    ref = mx.load(str(src / "model.safetensors"))
    assert set(weights) == set(ref)
    by_st = raw_tensors(dst / "model.safetensors")
    by_mlx = mx.load(str(dst / "model.safetensors"))
    for n, a in ref.items():
        assert by_st[n][2] == tensor_bytes(a) == tensor_bytes(by_mlx[n]), n
    if bits:
        assert any(w.dtype == mx.uint32 for w in weights.values())
    for n, a in ref.items():
        assert tensor_bytes(weights[n]) == tensor_bytes(a), n

    assert set(by_mlx) == set(ref)  # nothing added: mlx-lm loads it as it is

    baseline, _ = load_model(src)
    model, _ = pyloader.load_model(dst)
    streamed, _ = pyloader.load_model(dst, resident=0)
    plain, _ = load_model(dst)  # strict load_weights: no extra entries

    def greedy(m):
        return [int(t) for t, _ in generate_step(mx.array(PROMPT), m, max_tokens=8)]

    want = greedy(baseline)
    assert greedy(model) == want
    assert greedy(streamed) == want
    assert greedy(plain) == want


def test_atomic_on_failure(all_dtypes_file, tmp_path, monkeypatch):
    dst = tmp_path / "out.safetensors"
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 3:
            raise OSError(5, "injected I/O error")
        return real(*args)

    real = writer.copy_range
    monkeypatch.setattr(writer, "copy_range", failing)
    with pytest.raises(OSError, match="injected"):
        repack(all_dtypes_file, dst)
    assert list(tmp_path.iterdir()) == []  # neither DST nor a temporary left


def test_atomic_directory_and_overwrite(sharded_dir, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    repack(sharded_dir, dst, align=512)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    with pytest.raises(FileExistsError):
        repack(sharded_dir, dst, align=1024)
    monkeypatch.setattr(writer, "copy_range",
                        lambda *a: (_ for _ in ()).throw(OSError(28, "no space")))
    with pytest.raises(OSError, match="no space"):
        repack(sharded_dir, dst, align=1024, overwrite=True)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # old DST intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()
    repack(sharded_dir, dst, align=1024, overwrite=True)
    check_aligned(dst, 1024)


@pytest.mark.parametrize("align", [0, 12, 4, True, 3000])
def test_bad_align(all_dtypes_file, tmp_path, align):
    with pytest.raises(ValueError, match="power of two"):
        repack(all_dtypes_file, tmp_path / "x.safetensors", align=align)


def test_bad_source_is_a_format_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 2) + b"{}" + b"x")
    with pytest.raises(pyloader.FormatError):
        repack(bad, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_cli(all_dtypes_file, tmp_path, capsys):
    dst = tmp_path / "cli.safetensors"
    assert cli_main(["repack", str(all_dtypes_file), str(dst), "--align", "4096"]) == 0
    assert "4096-byte boundary" in capsys.readouterr().out
    check_aligned(dst, 4096)
    assert cli_main(["repack", str(all_dtypes_file), str(dst)]) == 2  # exists
    assert "exists" in capsys.readouterr().err


def test_copy_fallback_without_copy_file_range(all_dtypes_file, tmp_path, monkeypatch):
    def unsupported(*args):
        raise OSError(18, "cross-device")  # EXDEV

    monkeypatch.setattr(writer.os, "copy_file_range", unsupported)
    a = tmp_path / "a.safetensors"
    repack(all_dtypes_file, a, align=128)
    monkeypatch.undo()
    b = tmp_path / "b.safetensors"
    repack(all_dtypes_file, b, align=128)
    assert a.read_bytes() == b.read_bytes()
    shutil.rmtree(tmp_path)


def test_natural_layout_every_dtype(all_dtypes_file, tmp_path):
    """Default layout: every tensor on its dtype's boundary, the same entries as the
    source for every reader, zero-copy everywhere (the source copies some)."""
    dst = tmp_path / "natural.safetensors"
    result = repack(all_dtypes_file, dst)
    assert result.align is None and result.pad_entries == 0
    check_aligned(dst, None)
    assert pyloader.open(dst).metadata()["pyloader.align"] == "natural"
    ref = mx.load(str(all_dtypes_file))
    by_mlx, by_st = mx.load(str(dst)), raw_tensors(dst)
    assert set(by_mlx) == set(by_st) == set(ref)
    ours, stats = pyloader.load_with_stats(dst, "mmap")
    assert stats.copied_tensors == 0
    for n, a in ref.items():
        assert tensor_bytes(ours[n]) == tensor_bytes(by_mlx[n]) == by_st[n][2] == \
            tensor_bytes(a), n
    _, before = pyloader.load_with_stats(all_dtypes_file, "mmap")
    assert before.copied_tensors > 0


def test_natural_layout_pads_only_when_a_gap_is_unavoidable(tmp_path):
    """An odd-length U8 tensor in layer 0 leaves layer 1's F32 tensor off its boundary:
    one padding entry, hidden by pyloader, every tensor still aligned."""
    arrays = {"model.layers.0.odd": mx.arange(3, dtype=mx.uint8),
              "model.layers.1.w": mx.arange(4, dtype=mx.float32)}
    path = pyloader.save_safetensors(tmp_path / "odd.safetensors", arrays)
    ckpt = pyloader.open(path)
    assert len(ckpt.padding_names) == 1 and sorted(ckpt.keys()) == sorted(arrays)
    check = [t for t in ckpt.tensors() if t.name == "model.layers.1.w"][0]
    assert check.offset % 4 == 0 and check.aligned


@pytest.mark.parametrize("align", [None, 4096])
def test_save_safetensors_round_trips(tmp_path, align):
    arrays = {
        "model.layers.1.mlp.w": (mx.random.normal((32, 7), key=mx.random.key(1))
                                 ).astype(mx.bfloat16),
        "model.layers.0.b": mx.arange(5, dtype=mx.uint32),
        "model.layers.0.h": mx.arange(6, dtype=mx.float16),
        "scalar": mx.array(2.5),
        "empty": mx.zeros((0, 3)),
        "transposed": mx.arange(12, dtype=mx.int64).reshape(3, 4).T,  # not contiguous
        "flags": mx.array([True, False, True]),
        "c": mx.array([1 + 2j], dtype=mx.complex64),
        "i8": mx.array([-3, 4], dtype=mx.int8),
    }
    path = pyloader.save_safetensors(tmp_path / "out", arrays, {"format": "mlx"},
                                     align=align)
    assert path == tmp_path / "out.safetensors"  # the suffix is added, as by mx
    check_aligned(path, align)
    by_mlx, meta = mx.load(str(path), return_metadata=True)
    assert meta["format"] == "mlx"
    ours = pyloader.load(path)
    assert set(ours) == set(arrays)
    if align is None:
        assert set(by_mlx) == set(arrays)
    for n, a in arrays.items():
        for got in (by_mlx[n], ours[n]):
            assert got.dtype == a.dtype and got.shape == a.shape, n
            assert mx.array_equal(got, a).item(), n
    assert list(tmp_path.iterdir()) == [path]  # no temporary left


def test_save_safetensors_refuses_bad_input_naming_it(tmp_path):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(TypeError, match="'w'.*not an mx.array"):
        pyloader.save_safetensors(path, {"w": [1, 2]})
    with pytest.raises(TypeError, match="metadata"):
        pyloader.save_safetensors(path, {"w": mx.ones(2)}, {"k": 1})
    with pytest.raises(ValueError, match="reserved"):
        pyloader.save_safetensors(path, {"__pyloader_pad_0_0": mx.ones(2)})
    with pytest.raises(ValueError, match="power of two"):
        pyloader.save_safetensors(path, {"w": mx.ones(2)}, align=3000)
    assert list(tmp_path.iterdir()) == []


def test_save_safetensors_model_loads_in_mlx_lm(tmp_path):
    """A model saved through pyloader.save_safetensors: mlx_lm's strict load and
    pyloader give the tokens of the source; every tensor zero-copy."""
    src = make_model_dir(tmp_path / "src", "qwen3", dtype=mx.bfloat16, bits=4)
    dst = tmp_path / "dst"
    shutil.copytree(src, dst)
    weights = mx.load(str(src / "model.safetensors"))
    pyloader.save_safetensors(dst / "model.safetensors", weights, {"format": "mlx"})
    _, stats = pyloader.load_with_stats(dst)
    assert stats.copied_tensors == 0
    _, before = pyloader.load_with_stats(src)
    assert before.copied_tensors > 0

    def greedy(m):
        return [int(t) for t, _ in generate_step(mx.array(PROMPT), m, max_tokens=6)]

    want = greedy(load_model(src)[0])
    assert greedy(load_model(dst)[0]) == want
    assert greedy(pyloader.load_model(dst, resident=0)[0]) == want


def test_repack_in_place(sharded_dir, tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(sharded_dir, d)
    ref = pyloader.load(d, "mlx")
    index_before = (d / "model.safetensors.index.json").read_bytes()
    result = repack_in_place(d)
    assert len(result.files) == len(pyloader.open(d).files) and result.pad_entries == 0
    check_aligned(d, None)
    got = pyloader.load(d)
    assert set(got) == set(ref)
    for n in ref:
        assert tensor_bytes(got[n]) == tensor_bytes(ref[n]), n
    # No padding was added: the index is untouched; nothing left beside the shards.
    assert (d / "model.safetensors.index.json").read_bytes() == index_before
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in sharded_dir.iterdir())
    assert repack_in_place(d).files == []  # already aligned: nothing rewritten
    # The page layout in place: padding entries go into the index too.
    assert cli_main(["repack", str(d), "--in-place", "--align", "1024"]) == 0
    assert "1024-byte boundary" in capsys.readouterr().out
    check_aligned(d, 1024)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(pyloader.open(d).padding_names) <= set(index["weight_map"])
    assert cli_main(["repack", str(d)]) == 2  # neither DST nor --in-place


def test_repack_in_place_failure_keeps_the_shard(all_dtypes_file, tmp_path, monkeypatch):
    f = tmp_path / "m.safetensors"
    shutil.copy(all_dtypes_file, f)
    before = f.read_bytes()
    monkeypatch.setattr(writer, "copy_range",
                        lambda *a: (_ for _ in ()).throw(OSError(28, "no space")))
    with pytest.raises(OSError, match="no space"):
        repack_in_place(f)
    assert f.read_bytes() == before and list(tmp_path.iterdir()) == [f]


def test_misaligned_load_warns_once_with_the_fix(all_dtypes_file, tmp_path, caplog):
    f = tmp_path / "m.safetensors"
    shutil.copy(all_dtypes_file, f)
    with caplog.at_level("WARNING", logger="pyloader"):
        pyloader.load(f)
        pyloader.load(f)
    warned = [r.getMessage() for r in caplog.records if "not aligned" in r.getMessage()]
    assert len(warned) == 1
    assert str(f) in warned[0] and f"pyloader repack --in-place {f}" in warned[0]
    caplog.clear()
    repack_in_place(f)
    with caplog.at_level("WARNING", logger="pyloader"):
        pyloader.load(f)
    assert not [r for r in caplog.records if "not aligned" in r.getMessage()]
