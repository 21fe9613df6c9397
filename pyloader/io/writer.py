"""The aligned safetensors writer: every tensor zero-copy, still plain safetensors.

Layouts: **natural** (``align=None``: each tensor on its dtype's boundary, loads unchanged in
every reader) or **page** (``align=N``, gaps filled by hidden padding entries). The data section
starts on a page; tensors are ordered by layer. See docs/heads-and-repack.md.
"""

from __future__ import annotations

import errno
import json
import os
import struct

from pathlib import Path
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import mlx.core as mx

from .._util.fs import fault_point, named_errors, remove, remove_stale, tmp_sibling
from .._util.names import layer_order
from .checkpoint import ITEMSIZE, META_ALIGN, MLX_DTYPES, PAD_RE, Checkpoint

#: The page layout's default boundary, and where every layout's data section starts.
DEFAULT_ALIGN = PAGE = 16384
#: ``pyloader.align`` of a file in the natural layout.
NATURAL = "natural"


def check_align(align: int | None) -> None:
    """``align`` is None (the natural layout) or a power of two >= 8."""
    if align is None:
        return
    if isinstance(align, bool) or not isinstance(align, int) or align < 8 or align & (align - 1):
        raise ValueError(f"align must be None or a power of two >= 8, got {align!r}")


def align_label(align: int | None) -> str:
    """The ``pyloader.align`` metadata value of a layout."""
    return NATURAL if align is None else str(align)


class Entry(NamedTuple):
    """What :func:`plan_entries` needs of a tensor (a ``TensorMeta`` has it too)."""

    name: str
    dtype: str
    shape: tuple
    nbytes: int


def _natural_order(t) -> tuple:
    key = layer_order(t.name)
    return (key[0], key[1], -ITEMSIZE.get(t.dtype, 1), t.name)


def plan_entries(tensors, align: int | None, file_no: int):
    """Entries ``(name, dtype, shape, begin, end, source | None)`` in file order, gaps padded."""
    entries = []
    cursor = 0
    pads = 0
    order = _natural_order if align is None else (lambda t: layer_order(t.name))
    for t in sorted(tensors, key=order):
        gap = -cursor % (ITEMSIZE.get(t.dtype, 1) if align is None else align)
        if gap:
            entries.append((f"__pyloader_pad_{file_no}_{pads}", "U8", [gap], cursor,
                            cursor + gap, None))
            pads += 1
            cursor += gap
        entries.append((t.name, t.dtype, list(t.shape), cursor, cursor + t.nbytes, t))
        cursor += t.nbytes
    return entries


def header_bytes(entries, metadata: dict[str, str], align: int = PAGE) -> bytes:
    header: dict = {"__metadata__": metadata}
    for name, dtype, shape, begin, end, _ in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    # Trailing spaces (JSON whitespace) put the data section on the boundary.
    pad = -(8 + len(text)) % align
    return struct.pack("<Q", len(text) + pad) + text + b" " * pad


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    """Copy ``n`` bytes between descriptors at explicit offsets (in the kernel when it can)."""
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
                align: int | None, file_no: int = 0,
                extra_metadata: dict[str, str] | None = None,
                names: list[str] | None = None) -> tuple[list[str], int, int, int]:
    """Write one aligned file holding ``names`` (default: every tensor of ``src_file``); returns
    ``(names written, pad entries, pad bytes, header bytes)``."""
    check_align(align)
    if names is None:
        tensors = [t for t in ckpt.tensors() if t.file == src_file]
    else:
        tensors = [ckpt[n] for n in names]
    metadata = {k: v for k, v in ckpt.metadata(src_file).items() if k != META_ALIGN}
    metadata.update(extra_metadata or {})
    metadata[META_ALIGN] = align_label(align)
    entries = plan_entries(tensors, align, file_no)
    header = header_bytes(entries, metadata, align or PAGE)
    fds: dict[str, int] = {}
    with named_errors(dst_file):
        dst_fd = os.open(dst_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data_start = len(header)
        end = entries[-1][4] if entries else 0
        with named_errors(dst_file):
            os.write(dst_fd, header)
            os.ftruncate(dst_fd, data_start + end)  # padding reads back as zeros
        for _, _, _, begin, stop, t in entries:
            if t is None or stop == begin:
                continue
            if t.file not in fds:
                fds[t.file] = os.open(t.file, os.O_RDONLY)
            with named_errors(dst_file):
                copy_range(fds[t.file], dst_fd, t.offset, data_start + begin, stop - begin)
        with named_errors(dst_file):
            os.fsync(dst_fd)
    finally:
        os.close(dst_fd)
        for fd in fds.values():
            os.close(fd)
    pads = [e for e in entries if e[5] is None]
    return ([e[0] for e in entries if e[5] is not None], len(pads),
            sum(e[4] - e[3] for e in pads), len(header))


#: The safetensors name of each MLX dtype a file can hold.
SAFETENSORS_DTYPES = {v: k for k, v in MLX_DTYPES.items()}


def save_safetensors(path: str | os.PathLike[str], arrays: Mapping[str, mx.array],
                     metadata: Mapping[str, str] | None = None, *,
                     align: int | None = None) -> Path:
    """Write ``arrays`` to ``path``, every tensor zero-copy: a drop-in for ``mx.save_safetensors``.

    Raises:
        TypeError: a bad name, value, dtype or metadata entry (the message names it).
        ValueError: ``align`` is not a power of two >= 8, or a name is reserved.
    """
    check_align(align)
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"{path}: metadata must map str to str, got {k!r}: {v!r}")
    entries = []
    for name, a in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"{path}: tensor names must be str, got {name!r}")
        if name == "__metadata__" or PAD_RE.fullmatch(name):
            raise ValueError(f"{path}: tensor name {name!r} is reserved")
        if not isinstance(a, mx.array):
            raise TypeError(f"{path}: tensor {name!r} is a {type(a).__name__}, "
                            "not an mx.array")
        if a.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{path}: tensor {name!r} has dtype {a.dtype}, which "
                            "safetensors cannot hold")
        entries.append(Entry(name, SAFETENSORS_DTYPES[a.dtype], tuple(a.shape), a.nbytes))
    meta[META_ALIGN] = align_label(align)

    def chunks(name: str):
        a = mx.contiguous(arrays[name])
        mx.eval(a)
        yield memoryview(a).cast("B")

    write_tensors(path, entries, chunks, meta, align=align)
    return path


def write_tensors(path: str | os.PathLike[str], entries: Sequence[Entry],
                  chunks: Callable[[str], Iterable], metadata: Mapping[str, str], *,
                  align: int | None = None) -> None:
    """Write one aligned safetensors file whose tensors' bytes come from ``chunks(name)``, one
    tensor at a time (buffers that together hold exactly the tensor's ``nbytes``).

    Raises:
        ValueError: a tensor's chunks hold more or fewer bytes than its ``nbytes``.
    """
    path = Path(path)
    plan = plan_entries(entries, align, 0)
    header = header_bytes(plan, dict(metadata), align or PAGE)
    remove_stale(path)
    tmp = tmp_sibling(path)
    try:
        with named_errors(path):
            _write_planned(tmp, path, plan, header, chunks)
        fault_point(f"wrote {tmp}")
        os.replace(tmp, path)
        fault_point(f"renamed {tmp.name} to {path}")
    except BaseException:
        remove(tmp)
        raise


def _write_planned(tmp: Path, path: Path, plan, header: bytes, chunks) -> None:
    """Write the planned file at ``tmp`` (``path``: for messages)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, header)
        end = plan[-1][4] if plan else 0
        os.ftruncate(fd, len(header) + end)  # padding reads back as zeros
        for name, _, _, begin, stop, src in plan:
            if src is None or stop == begin:
                continue
            pos = len(header) + begin
            for chunk in chunks(name):
                view = memoryview(chunk).cast("B")
                if pos + len(view) > len(header) + stop:
                    raise ValueError(f"{path}: tensor {name!r}: the chunks hold more "
                                     f"than its {stop - begin} bytes")
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], pos + done)
                pos += len(view)
                del view
            if pos != len(header) + stop:
                raise ValueError(f"{path}: tensor {name!r}: the chunks hold "
                                 f"{pos - len(header) - begin} of its {stop - begin} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)
