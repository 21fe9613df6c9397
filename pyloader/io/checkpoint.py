"""Checkpoint index: what tensors a model has and where they live, without reading them."""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from .._native import core
from ..errors import GGUFFileError
from .gguf_header import is_gguf
from .hub import resolve

# Repack padding entries (files with ``pyloader.align`` metadata): hidden from every view.
PAD_RE = re.compile(r"__pyloader_pad_[0-9]+_[0-9]+")
#: ``__metadata__`` key of a file written with every tensor aligned (its value: the boundary).
META_ALIGN = "pyloader.align"

#: Bytes per element of each safetensors dtype (sub-byte types excluded).
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
            "C64": 8}
#: The MLX dtype of each safetensors dtype MLX has an array type for.
MLX_DTYPES = {
    "BOOL": mx.bool_, "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16,
    "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64, "F16": mx.float16,
    "BF16": mx.bfloat16, "F32": mx.float32, "F64": mx.float64, "C64": mx.complex64,
}


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives.

    Attributes:
        name: Tensor name.
        file: Path of the safetensors file holding it.
        dtype: safetensors dtype name (``"BF16"``, ``"U32"``, ...).
        shape: Tensor shape.
        offset: Absolute byte offset of the first byte in ``file``.
        nbytes: Byte length.
        aligned: ``offset`` is a multiple of the item size (zero-copy under mmap).
    """

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    aligned: bool


class Checkpoint:
    """A validated safetensors checkpoint: a file, a sharded model directory or a directory of
    ``*.safetensors`` files. Every violation raises :class:`pyloader.FormatError`."""

    def __init__(self, path: str | os.PathLike[str], revision: str | None = None):
        """``path``: a file, a directory or a repo id in the local hub cache at ``revision``."""
        self.path = os.fspath(resolve(path, revision))
        refuse_gguf(self.path)
        self._use_index(core.TensorIndex.open(self.path))

    @classmethod
    def of_index(cls, path: str | os.PathLike[str], index) -> Checkpoint:
        """The checkpoint of an index another format's reader built (``TensorIndex.of_regions``
        over a GGUF file)."""
        self = cls.__new__(cls)
        self.path = os.fspath(path)
        self._use_index(index)
        return self

    def _use_index(self, index) -> None:
        self.index = index
        files = self.index.files
        self.files: list[str] = [f.path for f in files]
        self._file_meta = [f.metadata for f in files]
        self._padding: frozenset[str] = frozenset()
        self._padding_bytes = 0
        padded = {i for i, meta in enumerate(self._file_meta) if META_ALIGN in dict(meta)}
        if padded:
            pads = [t for t in self.index.tensors()
                    if t.file_id in padded and t.dtype == "U8" and len(t.shape) == 1
                    and PAD_RE.fullmatch(t.name)]
            self._padding = frozenset(t.name for t in pads)
            self._padding_bytes = sum(t.nbytes for t in pads)

    @property
    def padding_names(self) -> frozenset[str]:
        """Names of the hidden padding entries (empty unless repacked)."""
        return self._padding

    def keys(self) -> list[str]:
        """Tensor names, in file order then offset order."""
        keys = self.index.keys()
        return [k for k in keys if k not in self._padding] if self._padding else keys

    def __len__(self) -> int:
        return len(self.index) - len(self._padding)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.index and name not in self._padding

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __getitem__(self, name: str) -> TensorMeta:
        if name in self._padding:
            raise KeyError(name)
        return self._meta(self.index[name])

    def tensors(self) -> list[TensorMeta]:
        """Metadata of every tensor."""
        return [self._meta(t) for t in self.index.tensors() if t.name not in self._padding]

    def _meta(self, t) -> TensorMeta:
        return TensorMeta(
            t.name, self.files[t.file_id], t.dtype, t.shape, t.offset, t.nbytes, t.aligned
        )

    def with_slices(self, slices: list[tuple[str, str, int, list[tuple[int, int]]]]
                    ) -> Checkpoint:
        """This checkpoint also serving each slice by name (ValueError for a range out of
        bounds)."""
        out = copy.copy(self)
        out.index = self.index.with_slices(
            [(n, t, int(a), [(int(b), int(e)) for b, e in r]) for n, t, a, r in slices])
        return out

    def extents(self, name: str) -> list[tuple[int, int]]:
        """The byte ranges ``(offset, length)`` of a tensor or slice, in element order."""
        return list(self.index[name].extents)

    def metadata(self, file: str | None = None) -> dict[str, str]:
        """One file's ``__metadata__``, or all files' merged (later shards win) when None."""
        if file is not None:
            return dict(self._file_meta[self.files.index(os.fspath(file))])
        return {k: v for meta in self._file_meta for k, v in dict(meta).items()}

    @property
    def total_nbytes(self) -> int:
        """Bytes of tensor data across all files (padding excluded)."""
        return self.index.total_nbytes - self._padding_bytes

    def alignment_summary(self) -> dict[str, int]:
        """How many tensors/bytes the mmap strategy can hand out without a copy."""
        ok = [t.nbytes for t in self.index.tensors()
              if t.name not in self._padding and (t.aligned or t.nbytes == 0)]
        return {"tensors": len(self), "bytes": self.total_nbytes, "aligned_tensors": len(ok),
                "aligned_bytes": sum(ok)}

    def __repr__(self) -> str:
        return (
            f"Checkpoint({self.path!r}, {len(self)} tensors, {len(self.files)} files, "
            f"{self.total_nbytes} bytes)"
        )


def refuse_gguf(path: str | os.PathLike[str]) -> None:
    """:class:`pyloader.GGUFFileError`, saying how to convert, for a GGUF ``path``."""
    p = os.fspath(path)
    found = [p] if is_gguf(p) else []
    if not found and os.path.isdir(p):
        names = sorted(os.listdir(p))
        if not any(n.endswith(".safetensors") for n in names):
            found = [os.path.join(p, n) for n in names if n.endswith(".gguf")
                     and is_gguf(os.path.join(p, n))]
    if found:
        what = ("a GGUF file" if found == [p] else
                f"no safetensors file, and {os.path.basename(found[0])} is a GGUF file")
        raise GGUFFileError(
            f"{p}: {what} (llama.cpp's format), not a safetensors checkpoint. pyloader reads "
            f"a GGUF file in place when given the file itself (pyloader.load_model, open and "
            f"load of {found[0]}), and `pyloader convert-gguf {found[0]} OUT_DIR` (or "
            "pyloader.gguf.convert_gguf) makes a model directory of it")
