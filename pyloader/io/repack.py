"""Aligned repack: rewrite a checkpoint so that every tensor is a zero-copy view.

:func:`repack` writes a copy (atomically; ``overwrite`` never replaces the source);
:func:`repack_in_place` rewrites shard by shard, each step atomic, and a killed run is completed
by running it again. See docs/heads-and-repack.md.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .._util.fs import (
    check_destination,
    commit,
    exchange,
    fault_point,
    remove,
    remove_stale,
    renamed_error,
    tmp_sibling,
    write_atomic,
)
from ..errors import FormatError
from .checkpoint import META_ALIGN, PAD_RE, Checkpoint
from .writer import align_label, check_align, write_aligned_file

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class RepackResult:
    """What :func:`repack` wrote."""

    src: str
    dst: str
    align: int | None    # None: the natural layout
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    pad_entries: int = 0
    pad_bytes: int = 0       # gap bytes between tensors
    header_bytes: int = 0    # 8-byte length fields + padded headers
    copied_files: list[str] = field(default_factory=list)


def repack(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
           align: int | None = None, overwrite: bool = False) -> RepackResult:
    """Write an aligned copy of a checkpoint.

    Args:
        src: A ``.safetensors`` file or a model directory.
        dst: Output path: a file when ``src`` is a file, else a directory.
        align: None (default, the natural layout) or every tensor's boundary (a power of two >= 8).
        overwrite: Replace an existing ``dst`` of the same kind, atomically.

    Raises:
        pyloader.FormatError: ``src`` breaks a rule of the format.
        FileExistsError: ``dst`` exists without ``overwrite``, is of the other type, or is a
            directory that is not a checkpoint.
        ValueError: ``dst`` is ``src`` or a directory holding it.
    """
    check_align(align)
    src_p, dst_p = Path(src), Path(dst)
    ckpt = Checkpoint(src_p)
    check_destination(dst_p, sources=[src_p, *ckpt.files], directory=src_p.is_dir(),
                      overwrite=overwrite, owned=is_checkpoint_dir)
    dst_p.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dst_p)
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
                fault_point(f"wrote {out}")
                result.files.append(str(dst_p / rel))
                weight_map.update(dict.fromkeys(Checkpoint(out).index.keys(), rel))
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
            fault_point(f"wrote {tmp}")
        else:
            _write_one(ckpt, ckpt.files[0], tmp, align, 0, result)
            result.files.append(str(dst_p))
        commit(tmp, dst_p, overwrite)
    except BaseException as exc:
        remove(tmp)
        raise renamed_error(exc, tmp, dst_p) from None
    return result


def repack_in_place(path: str | os.PathLike[str], *,
                    align: int | None = None) -> RepackResult:
    """Rewrite the checkpoint at ``path`` aligned, shard by shard; shards already in the layout
    are left alone (``result.files`` lists the ones rewritten).

    Raises:
        pyloader.FormatError: the checkpoint breaks a rule of the format.
    """
    check_align(align)
    root = Path(path)
    index_file = root / INDEX_FILE if root.is_dir() else None
    for f in [*(root.iterdir() if root.is_dir() else ()), root]:
        remove_stale(Path(os.path.realpath(f)))
    try:
        ckpt = Checkpoint(root)
    except FormatError:
        if index_file is None or not index_file.exists() or not _repair_index(root):
            raise
        ckpt = Checkpoint(root)
    result = RepackResult(src=str(root), dst=str(root), align=align)
    index = (json.loads(index_file.read_text())
             if index_file is not None and index_file.exists() else None)
    for i, f in enumerate(ckpt.files):
        tensors = [t for t in ckpt.tensors() if t.file == f]
        label = ckpt.metadata(f).get(META_ALIGN)
        if label == align_label(align) and all(t.aligned for t in tensors) and (
                align is None or all(t.offset % align == 0 for t in tensors)):
            continue
        real = Path(os.path.realpath(f))  # a symlinked shard is rewritten where it points
        tmp = tmp_sibling(real, "repack")
        remove(tmp)
        try:
            _write_one(ckpt, f, tmp, align, i, result)
            fault_point(f"wrote {tmp}")
            new_index = None
            if index is not None:
                rel = os.path.relpath(f, root)
                wm = {n: r for n, r in index["weight_map"].items()
                      if not (r == rel and PAD_RE.fullmatch(n))}
                wm.update({n: rel for n in sorted(Checkpoint(tmp).padding_names)})
                if wm != index["weight_map"]:
                    new_index = {**index, "weight_map": wm}
            swap = new_index is not None and not (Path(f).is_symlink()
                                                  or index_file.is_symlink())
            if not (swap and _swap_in(root, Path(f).name, tmp, new_index)):
                # With a new index, two renames: a kill between them leaves a shard whose
                # padding entries the index does not list yet; the next run repairs it
                # (_repair_index).
                os.replace(tmp, real)
                fault_point(f"renamed {tmp.name} to {real}")
                if new_index is not None:
                    write_atomic(index_file, json.dumps(new_index, indent=2))
            index = new_index or index
        except BaseException as exc:
            remove(tmp)
            raise renamed_error(exc, tmp, real) from None
        result.files.append(f)
    return result


def _swap_in(root: Path, shard: str, new_shard: Path, index: dict) -> bool:
    """Replace ``root/shard`` by ``new_shard`` and the index by ``index`` in one atomic step."""
    real_root = Path(os.path.realpath(root))
    swap = tmp_sibling(real_root, "swap")
    remove(swap)
    try:
        entries = [e for e in real_root.iterdir()
                   if e.name not in (shard, INDEX_FILE) and e != new_shard]
        if any(e.is_dir() and not e.is_symlink() for e in entries):
            return False
        swap.mkdir()
        for e in entries:
            os.link(e, swap / e.name, follow_symlinks=False)
        os.rename(new_shard, swap / shard)
        (swap / INDEX_FILE).write_text(json.dumps(index, indent=2))
        fault_point(f"built {swap}")
        exchange(swap, real_root)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM,
                             errno.EXDEV, errno.EMLINK):
            raise
        if (swap / shard).exists() and not new_shard.exists():
            os.rename(swap / shard, new_shard)  # back, for the two-rename path
        remove(swap)
        return False
    fault_point(f"exchanged {swap.name} and {real_root}")
    remove(swap)  # the old tree: the old shard and index go with it
    return True


def _repair_index(root: Path) -> bool:
    """Rewrite ``root``'s index to list each shard's padding entries (repairs a killed repack)."""
    index_file = root / INDEX_FILE
    try:
        index = json.loads(index_file.read_text())
        wm = index["weight_map"]
        shards = sorted(set(wm.values()))
        stored: dict[str, str] = {}
        pads: dict[str, str] = {}
        for rel in shards:
            ck = Checkpoint(root / rel)
            stored.update(dict.fromkeys(ck.keys(), rel))
            pads.update(dict.fromkeys(ck.padding_names, rel))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    real = {n: r for n, r in wm.items() if not PAD_RE.fullmatch(n)}
    if real != stored:
        return False
    repaired = {**real, **pads}
    if repaired == wm:
        return False
    write_atomic(index_file, json.dumps({**index, "weight_map": repaired}, indent=2))
    return True


def _write_one(ckpt: Checkpoint, src_file: str, out: Path, align: int, file_no: int,
               result: RepackResult) -> None:
    names, pads, pad_bytes, header = write_aligned_file(ckpt, src_file, out, align, file_no)
    result.tensors += len(names)
    result.tensor_bytes += sum(ckpt[n].nbytes for n in names)
    result.pad_entries += pads
    result.pad_bytes += pad_bytes
    result.header_bytes += header


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """``path`` is a model or checkpoint directory, which a repack may replace."""
    p = Path(path)
    return (p / "config.json").is_file() or (p / INDEX_FILE).is_file() or any(
        p.glob("*.safetensors"))
