"""The aligned safetensors writer: every tensor on a boundary, still plain safetensors.

The header is padded with JSON whitespace (spaces after the closing brace) so the data
section starts on the boundary, and the gaps between tensors are filled by *padding
entries*: ``U8`` tensors of shape ``[gap]`` named ``__pyloader_pad_<file>_<n>``
(safetensors forbids holes, so the gaps must belong to some tensor). The file's
``__metadata__`` records ``pyloader.align``; pyloader hides padding entries of such files
(:class:`pyloader.Checkpoint`), other readers show them as small ``uint8`` arrays.
Tensors are ordered by layer (:func:`pyloader._util.names.layer_order`), so one layer's
pages are contiguous and can be released exactly.
"""

from __future__ import annotations

import errno
import json
import os
import struct

from .._util.names import layer_order
from .checkpoint import META_ALIGN, Checkpoint, TensorMeta

DEFAULT_ALIGN = 16384


def check_align(align: int) -> None:
    if isinstance(align, bool) or not isinstance(align, int) or align < 8 or align & (align - 1):
        raise ValueError(f"align must be a power of two >= 8, got {align!r}")


def plan_entries(tensors: list[TensorMeta], align: int, file_no: int):
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


def header_bytes(entries, metadata: dict[str, str], align: int) -> bytes:
    header: dict = {"__metadata__": metadata}
    for name, dtype, shape, begin, end, _ in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    # Trailing spaces (JSON whitespace) put the data section on the boundary.
    pad = -(8 + len(text)) % align
    return struct.pack("<Q", len(text) + pad) + text + b" " * pad


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
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


def write_aligned_file(ckpt: Checkpoint, src_file: str, dst_file: str | os.PathLike[str],
                align: int, file_no: int = 0,
                extra_metadata: dict[str, str] | None = None,
                names: list[str] | None = None) -> tuple[list[str], int, int, int]:
    """Write one aligned file holding ``names`` (default: every tensor of
    ``src_file``; the tensors may come from any file of ``ckpt``).

    Returns ``(names written, pad entries, pad bytes, header bytes)``.
    """
    check_align(align)
    if names is None:
        tensors = [t for t in ckpt.tensors() if t.file == src_file]
    else:
        tensors = [ckpt[n] for n in names]
    metadata = {k: v for k, v in ckpt.metadata(src_file).items() if k != META_ALIGN}
    metadata.update(extra_metadata or {})
    metadata[META_ALIGN] = str(align)
    entries = plan_entries(tensors, align, file_no)
    header = header_bytes(entries, metadata, align)
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
            copy_range(fds[t.file], dst_fd, t.offset, data_start + begin, stop - begin)
        os.fsync(dst_fd)
    finally:
        os.close(dst_fd)
        for fd in fds.values():
            os.close(fd)
    pads = [e for e in entries if e[5] is None]
    return ([e[0] for e in entries if e[5] is not None], len(pads),
            sum(e[4] - e[3] for e in pads), len(header))
