"""Every writer is atomic as a whole: a writer killed at any step leaves the old output or
the new one, never a mix.

Each writer (``repack`` to a directory, ``repack --in-place``, ``convert-gguf`` into an
existing directory, ``heads build``) runs in a child process killed with SIGKILL at its
K-th step (``PYLOADER_FAULT_AT=K``: :func:`pyloader._util.fs.fault_point`, called after
every file written, every rename and every index write), for K = 1, 2, ... until a run
completes. After every kill the destination must load and be the old or the new state,
never a mix; a rerun must finish the job and leave no temporaries. A full disk (a small
tmpfs when the machine lets us mount one, else an injected ``ENOSPC``) must leave the old
state and name the file. ``--overwrite`` must never delete a source, a directory holding
one, or something of another type.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import pyloader
from helpers import tensor_bytes
from models import make_model_dir
from pyloader import heads
from pyloader.cli import main as cli_main
from pyloader.io import writer
from pyloader.io.checkpoint import META_ALIGN
from pyloader.io.repack import repack, repack_in_place

TESTS = Path(__file__).resolve().parent
TEMP_RE = re.compile(r"\..+\.(tmp|old|repack|swap)-[0-9]+")
MAX_STEPS = 40


def run_child(code: str, fault_at: int | None) -> int:
    """Run ``code`` in a fresh interpreter (killed at step ``fault_at``); its exit
    status (-9: killed by the fault point)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("PYLOADER_FAULT_AT", None)
    if fault_at is not None:
        env["PYLOADER_FAULT_AT"] = str(fault_at)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, -9), proc.stderr[-2000:]
    return proc.returncode


def temporaries(*dirs: Path) -> list[str]:
    return sorted(p.name for d in dirs if d.exists() for p in d.iterdir()
                  if TEMP_RE.fullmatch(p.name))


def contents(path: Path) -> dict[str, bytes]:
    return {n: tensor_bytes(a) for n, a in pyloader.load(path, "mmap").items()}


def labels(path: Path) -> set[str]:
    ck = pyloader.open(path)
    return {ck.metadata(f).get(META_ALIGN, "none") for f in ck.files}


def kill_at_every_step(code: str, reset, check_between, check_done) -> int:
    """Kill ``code`` at step 1, 2, ... until it completes; after each kill
    ``check_between()``, then a clean rerun and ``check_done()``; ``reset()`` puts the
    old state back before each try. Returns the number of kills."""
    kills = 0
    for k in range(1, MAX_STEPS):
        reset()
        if run_child(code, k) == 0:
            check_done()
            break
        kills += 1
        check_between()
        assert run_child(code, None) == 0
        check_done()
    else:
        pytest.fail(f"the writer still had steps left after {MAX_STEPS}")
    return kills


# ---------------------------------------------------------------------------- repack


def test_repack_over_an_existing_directory_killed_at_every_step(sharded_dir, tmp_path):
    ref = contents(sharded_dir)
    old = tmp_path / "old"
    repack(sharded_dir, old)  # the natural layout
    dst = tmp_path / "out"
    code = f"""
        from pyloader.io.repack import repack
        repack({str(sharded_dir)!r}, {str(dst)!r}, align=1024, overwrite=True)
    """

    def reset():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(old, dst)

    def between():
        assert contents(dst) == ref
        assert labels(dst) in ({"natural"}, {"1024"})  # old or new, never a mix

    def done():
        assert contents(dst) == ref and labels(dst) == {"1024"}
        assert temporaries(tmp_path) == []

    assert kill_at_every_step(code, reset, between, done) >= 4  # 3 shards + the swap


# ---------------------------------------------------------------------------- in place


def test_repack_in_place_page_layout_killed_at_every_step(sharded_dir, tmp_path):
    """``--align 16384`` adds padding entries, so each shard and the index change
    together: at every kill the directory must load, each shard old or new."""
    ref = contents(sharded_dir)
    d = tmp_path / "m"
    code = f"""
        from pyloader.io.repack import repack_in_place
        repack_in_place({str(d)!r}, align=16384)
    """

    def reset():
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(sharded_dir, d)

    def between():
        assert contents(d) == ref  # pyloader.open checks the index against the shards
        assert labels(d) <= {"none", "16384"}

    def done():
        assert contents(d) == ref and labels(d) == {"16384"}
        assert temporaries(d, tmp_path) == []

    assert kill_at_every_step(code, reset, between, done) >= 6


def test_rerun_repairs_an_index_left_by_a_killed_in_place_repack(sharded_dir, tmp_path):
    """The state an older pyloader left when killed between a shard's rename and the
    index's rewrite: load refuses it (a padding entry missing from the
    index) and ``repack --in-place`` used to refuse it too."""
    d = tmp_path / "m"
    shutil.copytree(sharded_dir, d)
    ref = contents(d)
    ck = pyloader.open(d)
    shard = ck.files[0]
    writer.write_aligned_file(ck, shard, d / "new", 16384, 0)
    os.replace(d / "new", shard)
    with pytest.raises(pyloader.FormatError, match="missing from"):
        pyloader.open(d)
    assert cli_main(["repack", str(d), "--in-place", "--align", "16384"]) == 0
    assert contents(d) == ref and labels(d) == {"16384"}


def test_repack_in_place_keeps_symlinked_shards_links(sharded_dir, tmp_path):
    """The Hugging Face cache layout: shards are links into blobs/. The links stay, the
    blobs are rewritten where they are, and no second copy of a shard is left."""
    ref = contents(sharded_dir)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(sharded_dir.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snap))
    before = sorted(p.name for p in blobs.iterdir())
    result = repack_in_place(snap)
    assert result.files
    assert all((snap / Path(f).name).is_symlink() for f in result.files)
    assert sorted(p.name for p in blobs.iterdir()) == before  # no copies, no temporaries
    assert not any(p.is_file() and not p.is_symlink() for p in snap.iterdir())
    assert contents(snap) == ref and labels(snap) == {"natural"}


def test_a_killed_writers_temporaries_are_removed_by_the_next_run(sharded_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(sharded_dir, d)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    shard = sorted(d.glob("*.safetensors"))[0]
    left = [d / f".{shard.name}.repack-{dead}", tmp_path / f".out.tmp-{dead}"]
    left[0].write_bytes(b"x" * 1000)
    left[1].mkdir()
    (left[1] / "model.safetensors").write_bytes(b"x")
    alive = tmp_path / f".out.tmp-{os.getppid()}"  # a live process's: kept
    alive.mkdir()
    repack_in_place(d)
    repack(d, tmp_path / "out")
    assert not left[0].exists() and not left[1].exists()
    assert alive.exists()


# ---------------------------------------------------------------------------- convert-gguf


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    from test_gguf import tiny_llama_gguf

    return tiny_llama_gguf(tmp_path / "tiny.gguf", {})


def _consistent_conversion(out: Path) -> str:
    """The dtype of a converted directory whose files agree with each other."""
    cfg = json.loads((out / "config.json").read_text())
    dtypes = {t.dtype for t in pyloader.open(out).tensors()}
    want = {"float16": "F16", "float32": "F32"}[cfg["torch_dtype"]]
    assert dtypes == {want}, (cfg["torch_dtype"], dtypes)  # never new config, old weights
    json.loads((out / "tokenizer.json").read_text())  # never a 0-byte tokenizer
    assert (out / "README.md").read_text() == "mine"  # the user's file is kept
    return cfg["torch_dtype"]


def test_convert_gguf_into_an_existing_directory_killed_at_every_step(tiny_gguf, tmp_path):
    from pyloader.gguf import convert_gguf

    old = tmp_path / "old"
    convert_gguf(tiny_gguf, old, dtype="f16")
    (old / "README.md").write_text("mine")
    out = tmp_path / "out"
    code = f"""
        from pyloader.gguf import convert_gguf
        convert_gguf({str(tiny_gguf)!r}, {str(out)!r}, dtype="f32")
    """

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(old, out)

    def between():
        assert _consistent_conversion(out) in ("float16", "float32")

    def done():
        assert _consistent_conversion(out) == "float32"
        assert temporaries(tmp_path) == []

    assert kill_at_every_step(code, reset, between, done) >= 5


def test_convert_gguf_into_a_sharded_model_directory_drops_its_weights_and_index(tiny_gguf,
                                                                                 tmp_path):
    """An older sharded model in the output directory: its shards, index, config and
    tokenizer are not carried over (they made a new config.json and model.safetensors
    sit beside an index pointing at the old shards, which load_model refused with a
    ConfigError); a user's README is."""
    from pyloader.gguf import convert_gguf

    out = make_model_dir(tmp_path / "out", "llama", dtype=mx.float32)
    weights = mx.load(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        mx.save_safetensors(str(out / shard), {n: weights[n] for n in part})
        weight_map.update({n: shard for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                  "weight_map": weight_map}))
    assert len(pyloader.open(out).files) == 2
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    (out / "README.md").write_text("mine")
    convert_gguf(tiny_gguf, out, dtype="f16")
    names = sorted(p.name for p in out.iterdir())
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]
    assert "generation_config.json" not in names
    assert (out / "README.md").read_text() == "mine"
    assert [Path(f).name for f in pyloader.open(out).files] == ["model.safetensors"]
    model, _ = pyloader.load_model(out, tokenizer=False)
    want = mx.load(str(out / "model.safetensors"))
    got = dict(tree_flatten(model.parameters()))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert mx.array_equal(got[k], v), k


@pytest.fixture
def small_fs(tmp_path):
    """A 200 KiB tmpfs (root only); None where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"cannot mount a tmpfs ({r.stderr.strip()}): injecting ENOSPC instead")
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_during_convert_gguf_names_the_file_and_keeps_the_old(tiny_gguf, tmp_path,
                                                                        small_fs, monkeypatch,
                                                                        capsys):
    root = small_fs if small_fs is not None else tmp_path / "fs"
    root.mkdir(exist_ok=True)
    out = root / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    if small_fs is None:
        real = os.pwrite

        def full(fd, data, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(writer.os, "pwrite", full)
    # f32: ~300 KB of weights on a 200 KiB file system
    assert cli_main(["convert-gguf", str(tiny_gguf), str(out), "--dtype", "f32"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err
    assert str(out / "model.safetensors") in err
    assert sorted(p.name for p in root.iterdir()) == ["out"]  # no temporaries
    assert [p.name for p in out.iterdir()] == ["README.md"]  # the old state
    if small_fs is None:
        monkeypatch.setattr(writer.os, "pwrite", real)


def test_full_disk_during_repack_leaves_the_source_and_no_temporaries(sharded_dir, tmp_path,
                                                                       small_fs):
    if small_fs is None:
        pytest.skip("needs a small file system (mount needs root); the injected ENOSPC "
                    "case is test_full_disk_during_convert_gguf_...")
    big = tmp_path / "big.safetensors"
    mx.save_safetensors(str(big), {"w": mx.zeros((300 << 10,), dtype=mx.uint8)})
    with pytest.raises(OSError) as e:
        repack(big, small_fs / "out.safetensors")
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(small_fs / "out.safetensors")  # not the temporary
    assert list(small_fs.iterdir()) == []


# ---------------------------------------------------------------------------- heads build


@pytest.fixture
def base_model(tmp_path) -> Path:
    return make_model_dir(tmp_path / "base", "llama", dtype=mx.float16)


def test_heads_build_over_an_existing_bundle_killed_at_every_step(base_model, tmp_path):
    old = tmp_path / "old"
    heads.build(base_model, {"a": base_model}, 1, old)
    out = tmp_path / "out"
    code = f"""
        from pyloader import heads
        heads.build({str(base_model)!r}, {{"a": {str(base_model)!r}, "b": {str(base_model)!r}}},
                    1, {str(out)!r}, overwrite=True)
    """

    def head_names() -> set[str]:
        directory = json.loads(pyloader.open(out / "trunk.safetensors").metadata()
                               ["pyloader.heads"])
        for h in directory["heads"].values():
            assert pyloader.open(out / h["file"]).keys()
        return set(directory["heads"])

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(old, out)

    def between():
        assert head_names() in ({"a"}, {"a", "b"})

    def done():
        assert head_names() == {"a", "b"}
        assert temporaries(tmp_path) == []

    assert kill_at_every_step(code, reset, between, done) >= 3


# ---------------------------------------------------------------------------- --overwrite


def test_overwrite_never_deletes_the_source_or_a_directory_holding_it(sharded_dir, tmp_path):
    parent = tmp_path / "parent"
    model = parent / "model"
    shutil.copytree(sharded_dir, model)
    (parent / "unrelated.txt").write_text("keep me")
    for dst in (parent, model, tmp_path):
        with pytest.raises(ValueError, match="source"):
            repack(model, dst, overwrite=True)
    assert cli_main(["repack", str(model), str(parent), "--overwrite"]) == 2
    assert (parent / "unrelated.txt").read_text() == "keep me"
    assert contents(model) == contents(sharded_dir)


def test_overwrite_never_replaces_another_type(all_dtypes_file, sharded_dir, tmp_path, capsys):
    d = tmp_path / "dir"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="directory"):
        repack(all_dtypes_file, d, overwrite=True)  # a file over a directory
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(FileExistsError, match="file"):
        repack(sharded_dir, f, overwrite=True)  # a directory over a file
    with pytest.raises(FileExistsError, match="did not make"):
        repack(sharded_dir, d, overwrite=True)  # a directory that is not a checkpoint
    assert (d / "notes.txt").read_text() == "keep me" and f.read_bytes() == b"x"
    repack(sharded_dir, tmp_path / "ok")
    repack(sharded_dir, tmp_path / "ok", align=64, overwrite=True)  # its own kind: fine
    assert labels(tmp_path / "ok") == {"64"}


def test_heads_build_overwrite_replaces_only_a_bundle(base_model, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("keep me")
    with pytest.raises(FileExistsError, match="did not make"):
        heads.build(base_model, {"a": base_model}, 1, out, overwrite=True)
    assert cli_main(["heads", "build", str(base_model), "--head", f"a={base_model}",
                     "--tail", "1", str(out), "--overwrite"]) == 2
    assert "did not make" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "keep me"
    with pytest.raises(ValueError, match="source"):
        heads.build(base_model, {"a": base_model}, 1, base_model, overwrite=True)
    bundle = tmp_path / "bundle"
    heads.build(base_model, {"a": base_model}, 1, bundle)
    heads.build(base_model, {"b": base_model}, 1, bundle, overwrite=True)  # a bundle: fine
    assert heads.is_bundle(bundle)


# ---------------------------------------------------------------------------- save_safetensors


def test_save_safetensors_over_an_existing_file_killed_at_every_step(tmp_path):
    f = tmp_path / "w.safetensors"
    code = f"""
        import mlx.core as mx
        import pyloader
        pyloader.save_safetensors({str(f)!r}, {{"w": mx.full((1000,), 2.0)}})
    """

    def reset():
        pyloader.save_safetensors(f, {"w": mx.full((1000,), 1.0)})

    def value() -> float:
        return float(pyloader.load(f)["w"][0])

    def between():
        assert value() in (1.0, 2.0)

    def done():
        assert value() == 2.0 and temporaries(tmp_path) == []

    assert kill_at_every_step(code, reset, between, done) >= 2


def test_full_disk_during_save_safetensors_names_the_file(tmp_path, small_fs):
    if small_fs is None:
        pytest.skip("needs a small file system (mount needs root)")
    f = small_fs / "w.safetensors"
    pyloader.save_safetensors(f, {"w": mx.zeros((10,))})
    with pytest.raises(OSError) as e:
        pyloader.save_safetensors(f, {"w": mx.zeros((100_000,))})  # 400 KB on 200 KiB
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(f)
    assert sorted(p.name for p in small_fs.iterdir()) == ["w.safetensors"]
    assert pyloader.load(f)["w"].shape == (10,)  # the old file
