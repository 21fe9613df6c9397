"""Aligned repack: rewrite a checkpoint so that every tensor is a zero-copy view.

``mx.save_safetensors`` packs tensors back to back after an unpadded header,
so most tensors of real MLX checkpoints sit at offsets the mmap strategy has to
copy. :func:`repack` writes the same tensors, ordered by layer, in one of the aligned
layouts of :mod:`pyloader.io.writer`: by default the natural one (each tensor on its
dtype's boundary, the data section on a page, nothing added: ``mlx_lm.load`` and every
other reader load it unchanged), or with ``align=N`` every tensor on an ``N``-byte
boundary (padding entries, which pyloader hides and strict ``mlx_lm.load`` refuses).

Sharded checkpoints are repacked shard by shard (same shard names) with a new
``model.safetensors.index.json``; the other files of a model directory
(``config.json``, tokenizer files, ...) are copied. The destination is
written under a temporary name and renamed into place once complete.

:func:`repack_in_place` rewrites a checkpoint where it is, shard by shard: each shard is
written beside itself and renamed over it (temporary space: one shard), so an
interruption leaves every shard either old or new, both complete and equal in content.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .._util.fs import commit, remove, tmp_sibling, write_atomic
from .checkpoint import META_ALIGN, PAD_RE, Checkpoint
from .writer import align_label, check_align, write_aligned_file

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class RepackResult:
    """What :func:`repack` wrote."""

    src: str
    dst: str
    align: Optional[int]    # None: the natural layout
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    pad_entries: int = 0
    pad_bytes: int = 0       # gap bytes between tensors
    header_bytes: int = 0    # 8-byte length fields + padded headers
    copied_files: list[str] = field(default_factory=list)


def repack(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
           align: Optional[int] = None, overwrite: bool = False) -> RepackResult:
    """Write an aligned copy of a checkpoint.

    Args:
        src: A ``.safetensors`` file or a model directory (single file, sharded
            with ``model.safetensors.index.json``, or a directory of
            ``*.safetensors`` files).
        dst: Output path: a file when ``src`` is a file, else a directory.
        align: None (default): the natural layout; else the boundary every tensor
            starts on (a power of two >= 8; padding entries fill the gaps).
        overwrite: Replace an existing ``dst`` (atomically by rename).

    Raises:
        pyloader.FormatError: ``src`` breaks a rule of the format.
        FileExistsError: ``dst`` exists and ``overwrite`` is False.
    """
    check_align(align)
    src_p, dst_p = Path(src), Path(dst)
    ckpt = Checkpoint(src_p)
    if (dst_p.exists() or dst_p.is_symlink()) and not overwrite:
        raise FileExistsError(17, "destination exists (pass overwrite=True)", str(dst_p))
    dst_p.parent.mkdir(parents=True, exist_ok=True)
    result = RepackResult(src=str(src_p), dst=str(dst_p), align=align)
    tmp = tmp_sibling(dst_p, "tmp")
    remove(tmp)
    try:
        if src_p.is_dir():
            tmp.mkdir()
            weight_map: dict[str, str] = {}
            for i, f in enumerate(ckpt.files):
                rel = os.path.relpath(f, src_p)
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                _write_one(ckpt, f, out, align, i, result)
                result.files.append(str(dst_p / rel))
                hidden = Checkpoint(out)
                for n in hidden.index.keys():
                    weight_map[n] = rel
            if (src_p / INDEX_FILE).exists():
                index = json.loads((src_p / INDEX_FILE).read_text())
                meta = dict(index.get("metadata") or {})
                meta["total_size"] = result.tensor_bytes
                meta[META_ALIGN] = align_label(align)
                (tmp / INDEX_FILE).write_text(
                    json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2))
            for entry in sorted(src_p.iterdir()):
                if (entry.is_file() and entry.suffix != ".safetensors"
                        and entry.name != INDEX_FILE):
                    shutil.copy2(entry, tmp / entry.name)
                    result.copied_files.append(entry.name)
        else:
            _write_one(ckpt, ckpt.files[0], tmp, align, 0, result)
            result.files.append(str(dst_p))
        commit(tmp, dst_p, overwrite)
    except BaseException:
        remove(tmp)
        raise
    return result


def repack_in_place(path: str | os.PathLike[str], *,
                    align: Optional[int] = None) -> RepackResult:
    """Rewrite the checkpoint at ``path`` (a file or model directory) aligned, shard by
    shard (see the module doc); shards already in the requested layout are left alone
    (``result.files`` lists the ones rewritten). Tensor contents, names, the other
    files and the shard names do not change; a sharded checkpoint's index is rewritten
    (atomically, after each shard) only when padding entries were added.

    Raises:
        pyloader.FormatError: the checkpoint breaks a rule of the format.
    """
    check_align(align)
    root = Path(path)
    ckpt = Checkpoint(root)
    result = RepackResult(src=str(root), dst=str(root), align=align)
    index_file = root / INDEX_FILE if root.is_dir() else None
    index = (json.loads(index_file.read_text())
             if index_file is not None and index_file.exists() else None)
    for i, f in enumerate(ckpt.files):
        tensors = [t for t in ckpt.tensors() if t.file == f]
        label = ckpt.metadata(f).get(META_ALIGN)
        if label == align_label(align) and all(t.aligned for t in tensors) and (
                align is None or all(t.offset % align == 0 for t in tensors)):
            continue
        tmp = tmp_sibling(f, "repack")
        remove(tmp)
        try:
            _write_one(ckpt, f, tmp, align, i, result)
            os.replace(tmp, f)
        except BaseException:
            remove(tmp)
            raise
        result.files.append(f)
        if index is not None:
            rel = os.path.relpath(f, root)
            pads = Checkpoint(f).padding_names
            wm = {n: r for n, r in index["weight_map"].items()
                  if not (r == rel and PAD_RE.fullmatch(n))}
            wm.update({n: rel for n in sorted(pads)})
            if wm != index["weight_map"]:
                index["weight_map"] = wm
                write_atomic(index_file, json.dumps(index, indent=2))
    return result


def _write_one(ckpt: Checkpoint, src_file: str, out: Path, align: int, file_no: int,
               result: RepackResult) -> None:
    names, pads, pad_bytes, header = write_aligned_file(ckpt, src_file, out, align, file_no)
    result.tensors += len(names)
    result.tensor_bytes += sum(ckpt[n].nbytes for n in names)
    result.pad_entries += pads
    result.pad_bytes += pad_bytes
    result.header_bytes += header


def is_padding_name(name: str) -> bool:
    """The name has the form of a repack padding entry."""
    return PAD_RE.fullmatch(name) is not None
