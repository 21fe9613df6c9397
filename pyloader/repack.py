"""Aligned repack: rewrite a checkpoint so that every tensor starts on a boundary.

``mx.save_safetensors`` packs tensors back to back after an unpadded header,
so most tensors of real MLX checkpoints sit at offsets the mmap strategy has to
copy. :func:`repack` writes the same tensors, ordered by layer, each starting
at a multiple of ``align`` (default 16 KiB: a page on every common OS), so that
every tensor is a zero-copy view and one layer's pages can be released exactly.

The result is still a plain safetensors file, readable by every reader:

* the header is padded with JSON whitespace (spaces after the closing brace)
  so the data section starts on the boundary;
* the gaps between tensors are filled by *padding entries*: ``U8`` tensors of
  shape ``[gap]`` named ``__pyloader_pad_<file>_<n>`` (safetensors forbids
  holes, so the gaps must belong to some tensor). The file's ``__metadata__``
  records ``pyloader.align``; pyloader hides padding entries of such files
  (:class:`pyloader.Checkpoint`, :func:`pyloader.load`,
  :func:`pyloader.load_model`), other readers show them as small ``uint8``
  arrays.

Sharded checkpoints are repacked shard by shard (same shard names) with a new
``model.safetensors.index.json``; the other files of a model directory
(``config.json``, tokenizer files, ...) are copied. The destination is
written under a temporary name and renamed into place once complete.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import PAD_RE, Checkpoint, TensorMeta

DEFAULT_ALIGN = 16384
META_ALIGN = "pyloader.align"
INDEX_FILE = "model.safetensors.index.json"
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


@dataclass
class RepackResult:
    """What :func:`repack` wrote."""

    src: str
    dst: str
    align: int
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    pad_entries: int = 0
    pad_bytes: int = 0       # gap bytes between tensors
    header_bytes: int = 0    # 8-byte length fields + padded headers
    copied_files: list[str] = field(default_factory=list)


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to (``model.layers.7.mlp...`` → 7)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def layer_order(name: str) -> tuple:
    """Sort key: embeddings and other inputs first, then layer by layer, then
    the final norm, lm_head and anything else."""
    i = layer_of(name)
    if i is not None:
        return (1, i, name)
    return (0 if "embed" in name else 2, 0, name)


def _check_align(align: int) -> None:
    if isinstance(align, bool) or not isinstance(align, int) or align < 8 or align & (align - 1):
        raise ValueError(f"align must be a power of two >= 8, got {align!r}")


def _plan(tensors: list[TensorMeta], align: int, file_no: int):
    """Entries ``(name, dtype, shape, begin, end, source TensorMeta | None)``
    in file order, relative to the (aligned) data section, with padding
    entries filling the gaps."""
    entries = []
    cursor = 0
    pads = 0
    for t in sorted(tensors, key=lambda t: layer_order(t.name)):
        gap = -cursor % align
        if gap:
            entries.append((f"__pyloader_pad_{file_no}_{pads}", "U8", [gap], cursor,
                            cursor + gap, None))
            pads += 1
            cursor += gap
        entries.append((t.name, t.dtype, list(t.shape), cursor, cursor + t.nbytes, t))
        cursor += t.nbytes
    return entries


def _header_bytes(entries, metadata: dict[str, str], align: int) -> bytes:
    header: dict = {"__metadata__": metadata}
    for name, dtype, shape, begin, end, _ in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    # Trailing spaces (JSON whitespace) put the data section on the boundary.
    pad = -(8 + len(text)) % align
    return struct.pack("<Q", len(text) + pad) + text + b" " * pad


def _copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    """Copy ``n`` bytes between descriptors at explicit offsets (in the kernel
    when it can, else through a buffer)."""
    done = 0
    while done < n:
        try:
            k = os.copy_file_range(src_fd, dst_fd, n - done, src_off + done, dst_off + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            break
        if k == 0:
            raise OSError(errno.EIO, f"unexpected end of file at offset {src_off + done}")
        done += k
    while done < n:
        data = os.pread(src_fd, min(16 << 20, n - done), src_off + done)
        if not data:
            raise OSError(errno.EIO, f"unexpected end of file at offset {src_off + done}")
        view = memoryview(data)
        while view:
            w = os.pwrite(dst_fd, view, dst_off + done)
            view = view[w:]
            done += w


def repack_file(ckpt: Checkpoint, src_file: str, dst_file: str | os.PathLike[str],
                align: int, file_no: int = 0,
                extra_metadata: dict[str, str] | None = None,
                names: list[str] | None = None) -> tuple[list[str], int, int, int]:
    """Write one aligned file holding ``names`` (default: every tensor of
    ``src_file``; the tensors may come from any file of ``ckpt``).

    Returns ``(names written, pad entries, pad bytes, header bytes)``.
    """
    _check_align(align)
    if names is None:
        tensors = [t for t in ckpt.tensors() if t.file == src_file]
    else:
        tensors = [ckpt[n] for n in names]
    metadata = {k: v for k, v in ckpt.metadata(src_file).items() if k != META_ALIGN}
    metadata.update(extra_metadata or {})
    metadata[META_ALIGN] = str(align)
    entries = _plan(tensors, align, file_no)
    header = _header_bytes(entries, metadata, align)
    fds: dict[str, int] = {}
    dst_fd = os.open(dst_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(dst_fd, header)
        data_start = len(header)
        end = entries[-1][4] if entries else 0
        os.ftruncate(dst_fd, data_start + end)  # padding reads back as zeros
        for _, _, _, begin, stop, t in entries:
            if t is None or stop == begin:
                continue
            if t.file not in fds:
                fds[t.file] = os.open(t.file, os.O_RDONLY)
            _copy_range(fds[t.file], dst_fd, t.offset, data_start + begin, stop - begin)
        os.fsync(dst_fd)
    finally:
        os.close(dst_fd)
        for fd in fds.values():
            os.close(fd)
    pads = [e for e in entries if e[5] is None]
    return ([e[0] for e in entries if e[5] is not None], len(pads),
            sum(e[4] - e[3] for e in pads), len(header))


def _tmp_sibling(dst: Path, tag: str) -> Path:
    return dst.with_name(f".{dst.name}.{tag}-{os.getpid()}")


def commit(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename a complete ``tmp`` (file or directory) to ``dst``; an existing
    ``dst`` is replaced only with ``overwrite``, and never left half-written."""
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(17, "destination exists (pass overwrite=True)", str(dst))
        if dst.is_dir() and not dst.is_symlink():
            old = _tmp_sibling(dst, "old")
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old)
            return
    os.replace(tmp, dst)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def repack(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
           align: int = DEFAULT_ALIGN, overwrite: bool = False) -> RepackResult:
    """Write an aligned copy of a checkpoint.

    Args:
        src: A ``.safetensors`` file or a model directory (single file, sharded
            with ``model.safetensors.index.json``, or a directory of
            ``*.safetensors`` files).
        dst: Output path: a file when ``src`` is a file, else a directory.
        align: Boundary every tensor starts on (a power of two >= 8; default
            16384).
        overwrite: Replace an existing ``dst`` (atomically by rename).

    Raises:
        pyloader.FormatError: ``src`` breaks a rule of the format.
        FileExistsError: ``dst`` exists and ``overwrite`` is False.
    """
    _check_align(align)
    src_p, dst_p = Path(src), Path(dst)
    ckpt = Checkpoint(src_p)
    if (dst_p.exists() or dst_p.is_symlink()) and not overwrite:
        raise FileExistsError(17, "destination exists (pass overwrite=True)", str(dst_p))
    dst_p.parent.mkdir(parents=True, exist_ok=True)
    result = RepackResult(src=str(src_p), dst=str(dst_p), align=align)
    tmp = _tmp_sibling(dst_p, "tmp")
    _remove(tmp)
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
                meta[META_ALIGN] = align
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
        _remove(tmp)
        raise
    return result


def _write_one(ckpt: Checkpoint, src_file: str, out: Path, align: int, file_no: int,
               result: RepackResult) -> None:
    names, pads, pad_bytes, header = repack_file(ckpt, src_file, out, align, file_no)
    result.tensors += len(names)
    result.tensor_bytes += sum(ckpt[n].nbytes for n in names)
    result.pad_entries += pads
    result.pad_bytes += pad_bytes
    result.header_bytes += header


def is_padding_name(name: str) -> bool:
    """The name has the form of a repack padding entry."""
    return PAD_RE.fullmatch(name) is not None
