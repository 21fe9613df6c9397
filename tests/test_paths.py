"""What a checkpoint's paths are, said: a device, a directory, a FIFO, a symbolic link
loop, a link to nothing and a missing file each get their own message naming the path;
one file named two ways is one shard; a NUL in a file name is refused."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import pyloader
from pyloader.io.config import check_config
from pyloader.io.inspect import inspect_checkpoint


def _shard(path, names):
    mx.save_safetensors(str(path), {n: mx.arange(2, dtype=mx.float32) + i
                                    for i, n in enumerate(names)})


def _refused(path, exc_type, err, *fragments):
    with pytest.raises(exc_type) as info:
        pyloader.open(path)
    e = info.value
    assert e.errno == err, e
    for f in fragments:
        assert f in str(e), str(e)
    return e


def test_a_shard_linked_to_a_device(tmp_path):
    (tmp_path / "model.safetensors").symlink_to("/dev/zero")
    e = _refused(tmp_path, OSError, errno.EINVAL, "a character device, not a regular file")
    assert e.filename == str(tmp_path / "model.safetensors")


def test_a_shard_linked_to_a_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "model.safetensors").symlink_to("sub")
    _refused(tmp_path, IsADirectoryError, errno.EISDIR, "a directory, not a regular file",
             str(tmp_path / "model.safetensors"))


def test_a_shard_that_is_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    _refused(tmp_path, OSError, errno.EINVAL, "a FIFO, not a regular file")
    _refused(tmp_path / "model.safetensors", OSError, errno.EINVAL, "a FIFO")


def test_a_symbolic_link_loop(tmp_path):
    """The checkpoint path itself a loop: not taken for a Hugging Face repo id."""
    (tmp_path / "loop").symlink_to("loop")
    _refused(tmp_path / "loop", OSError, errno.ELOOP, "a symbolic link loop")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").symlink_to("model.safetensors")
    _refused(tmp_path / "d", OSError, errno.ELOOP, "a symbolic link loop",
             str(tmp_path / "d" / "model.safetensors"))


def test_an_index_that_is_a_loop_is_not_ignored(tmp_path):
    _shard(tmp_path / "s1.safetensors", ["a"])
    (tmp_path / "model.safetensors.index.json").symlink_to("x")
    (tmp_path / "x").symlink_to("model.safetensors.index.json")
    _refused(tmp_path, OSError, errno.ELOOP, "a symbolic link loop", "index.json")


def test_a_link_to_nothing_and_a_missing_file(tmp_path):
    _shard(tmp_path / "s1.safetensors", ["a"])
    (tmp_path / "s2.safetensors").symlink_to("blob-gone")
    _refused(tmp_path, FileNotFoundError, errno.ENOENT,
             "a symbolic link to 'blob-gone', which does not exist", "s2.safetensors")
    with pytest.raises(FileNotFoundError, match="no such file"):
        pyloader.open(tmp_path / "missing.safetensors")


def test_one_file_named_two_ways_in_the_index_is_one_shard(tmp_path):
    _shard(tmp_path / "s1.safetensors", ["a", "b"])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "s1.safetensors", "b": "./s1.safetensors"}}))
    ck = pyloader.open(tmp_path)
    assert len(ck.files) == 1 and sorted(ck.keys()) == ["a", "b"]
    w = pyloader.load(tmp_path)
    assert w["b"].tolist() == [1.0, 2.0]


def test_a_shard_and_a_link_to_it_are_one_shard(tmp_path):
    _shard(tmp_path / "s1.safetensors", ["a"])
    (tmp_path / "s2.safetensors").symlink_to("s1.safetensors")
    assert pyloader.open(tmp_path).files == [str(tmp_path / "s1.safetensors")]


def test_an_index_naming_two_files_for_one_tensor_is_still_refused(tmp_path):
    _shard(tmp_path / "s1.safetensors", ["a"])
    _shard(tmp_path / "s2.safetensors", ["b"])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "s1.safetensors", "b": "./s1.safetensors"}}))
    with pytest.raises(pyloader.FormatError, match="'b'.*does not contain it"):
        pyloader.open(tmp_path)


def test_a_nul_in_a_weight_map_name(tmp_path):
    _shard(tmp_path / "s1.safetensors", ["a"])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "s1.safetensors\u0000.bak"}}))
    with pytest.raises(pyloader.FormatError,
                       match=r"index.json: tensor 'a': weight_map file name contains a NUL"):
        pyloader.open(tmp_path)


def test_a_nul_in_a_path(tmp_path):
    _shard(tmp_path / "s1.safetensors", ["a"])
    with pytest.raises((OSError, ValueError), match="NUL|null"):
        pyloader.open(str(tmp_path / "s1.safetensors") + "\0junk")


def test_config_json_a_directory_or_a_loop(tmp_path):
    _shard(tmp_path / "model.safetensors", ["a"])
    (tmp_path / "config.json").mkdir()
    with pytest.raises(pyloader.ConfigError, match="config.json: must be a regular file, "
                                                   "not a directory"):
        check_config(tmp_path)
    with pytest.raises(IsADirectoryError, match="config.json is a directory"):
        inspect_checkpoint(tmp_path)
    (tmp_path / "config.json").rmdir()
    (tmp_path / "config.json").symlink_to("config.json")
    with pytest.raises(OSError, match="config.json is a symbolic link loop") as info:
        check_config(tmp_path)
    assert info.value.errno == errno.ELOOP
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").symlink_to("gone.json")
    with pytest.raises(FileNotFoundError, match="a symbolic link to 'gone.json'"):
        check_config(tmp_path)


def test_a_side_file_linked_to_nothing(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").symlink_to("blob-gone")
    with pytest.raises(FileNotFoundError, match="tokenizer.json is a symbolic link to "
                                                "'blob-gone', which does not exist"):
        check_config(tmp_path)


@pytest.mark.parametrize("kind", ["directory", "fifo", "loop", "device"])
def test_gguf_input_paths(tmp_path, kind):
    from pyloader.gguf import read_gguf

    p = tmp_path / "m.gguf"
    want = {"directory": "a directory", "fifo": "a FIFO", "loop": "a symbolic link loop",
            "device": "a character device"}[kind]
    if kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "loop":
        p.symlink_to(p.name)
    else:
        p.symlink_to("/dev/zero")
    with pytest.raises(OSError, match=f"GGUF file is {want}, not a regular file"):
        read_gguf(p)
    cli = subprocess.run([sys.executable, "-m", "pyloader", "convert-gguf", str(p),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and f"{p}: {want}, not a GGUF file" in cli.stderr, cli.stderr
