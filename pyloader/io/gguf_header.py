"""A GGUF file's header, read and checked completely without MLX, before MLX sees the file.

Each rule raises :class:`pyloader.FormatError` naming the file, the key or tensor, and the rule.
See docs/format-rules.md ("GGUF").
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .files import open_regular
from ..errors import FormatError, UnsupportedError

#: ggml tensor types: id -> (name, elements per block, bytes per block), as llama.cpp's gguf-py
#: (``GGML_QUANT_SIZES``) lists them; missing ids (removed types) are refused.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}

#: Metadata value types (GGUF ``gguf_type``).
VALUE_TYPE_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool",
                    "string", "array", "uint64", "int64", "float64")
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
UINT32, STRING, ARRAY = 4, 8, 9

#: ggml's ``GGML_MAX_DIMS``: no GGUF writer produces more dimensions.
GGML_MAX_DIMS = 4
#: Deepest array nesting read (an array holding arrays is depth 2).
MAX_NESTING = 64
#: Elements of one metadata array at most (MLX builds it as an array with a 32-bit size).
MAX_ARRAY_LENGTH = 2**31 - 1
_INT64_MAX = 2**63 - 1
_HEADER_FIXED = 24  # magic, version, tensor count, key count
_MIN_KV = 8 + 4 + 1  # empty key, type, a one-byte value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # empty name, no dimension, type, offset
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: Tensor name.
        type_id: ggml type id; ``type_name`` its name (``"Q4_0"``).
        shape: Row-major shape (GGUF lists dimensions innermost first).
        offset: Absolute byte offset of the data in the file.
        nbytes: Bytes of data (whole blocks).
    """

    name: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A checked GGUF header.

    Attributes:
        path: The file.
        version: GGUF version (2 or 3).
        value_types: Metadata key -> value type name (``"array[ELEMENT]"`` for an array).
        nesting: Metadata key -> array nesting depth (0 for a scalar or a string).
        alignment: The data alignment (``general.alignment``, default 32).
        data_offset: Where the tensor data section starts.
        tensors: Tensor name -> :class:`GGUFTensorInfo`, in header order.
        size: File size in bytes.
        values: Metadata key -> value (numbers, strings, lists), when read with
            ``values=True``; else None.
    """

    path: str
    version: int
    value_types: dict[str, str]
    nesting: dict[str, int]
    alignment: int
    data_offset: int
    tensors: dict[str, GGUFTensorInfo]
    size: int
    values: dict[str, Any] | None = None


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos = buf, path, 0
        self.size = len(buf)

    def fail(self, where: str, rule: str) -> FormatError:
        return FormatError(f"{self.path}: {where}{': ' if where else ''}{rule}")

    def take(self, fmt: str, where: str) -> tuple:
        n = struct.calcsize(fmt)
        if n > self.size - self.pos:
            raise self.fail(where, f"header ends early (at byte {self.pos} of {self.size})")
        vals = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return vals

    def skip(self, n: int, where: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(where, f"header ends early ({n} bytes needed at byte {self.pos} "
                                   f"of {self.size})")
        self.pos += n

    def string(self, where: str, what: str) -> str:
        (n,) = self.take("<Q", where)
        start = self.pos
        self.skip(n, where)
        try:
            return bytes(self.buf[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(where, f"{what} is not valid UTF-8") from None


def _type_name(vtype: int) -> str:
    return VALUE_TYPE_NAMES[vtype] if 0 <= vtype < len(VALUE_TYPE_NAMES) else str(vtype)


def _read_value(cur: _Cursor, vtype: int, where: str) -> tuple[str, int, int | None]:
    """Consume one metadata value: (type name, nesting depth, the uint32 value or None)."""
    if vtype in _SCALAR_SIZES:
        start = cur.pos
        cur.skip(_SCALAR_SIZES[vtype], where)
        u32 = struct.unpack_from("<I", cur.buf, start)[0] if vtype == UINT32 else None
        return VALUE_TYPE_NAMES[vtype], 0, u32
    if vtype == STRING:
        cur.string(where, "string value")
        return "string", 0, None
    if vtype != ARRAY:
        raise cur.fail(where, f"unknown value type {vtype} (known: 0-12)")
    # stack: [arrays left to read at this level, their element type]
    stack: list[list[int]] = []
    etypes: list[int] = []
    deepest = 0
    while True:
        depth = len(stack) + 1
        if depth > MAX_NESTING:
            raise cur.fail(where, f"arrays nested deeper than {MAX_NESTING}")
        etype, count = cur.take("<IQ", where)
        if len(etypes) < depth:
            etypes.append(etype)
        deepest = max(deepest, depth)
        if count > MAX_ARRAY_LENGTH:
            raise cur.fail(where, f"array of {count} elements (at most {MAX_ARRAY_LENGTH})")
        left = cur.size - cur.pos
        if etype in _SCALAR_SIZES:
            cur.skip(_SCALAR_SIZES[etype] * count, where)
        elif etype == STRING:
            if count * 8 > left:
                raise cur.fail(where, f"array of {count} strings cannot fit in the "
                                      f"{left} bytes left in the file")
            for _ in range(count):
                cur.string(where, "string element")
        elif etype == ARRAY:
            if count * 12 > left:
                raise cur.fail(where, f"array of {count} arrays cannot fit in the "
                                      f"{left} bytes left in the file")
            stack.append([count, etype])
        else:
            raise cur.fail(where, f"unknown array element type {etype} (known: 0-12)")
        while stack and stack[-1][0] == 0:
            stack.pop()
        if not stack:
            break
        stack[-1][0] -= 1
    name = _type_name(etypes[-1])
    for e in reversed(etypes[:-1]):
        name = f"array[{name}]" if e == ARRAY else name
    return f"array[{name}]", deepest, None


GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """``path`` is a regular file starting with GGUF's magic (False for anything else)."""
    try:
        with open_regular(path) as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def read_header(path: str | os.PathLike[str], *, values: bool = False) -> GGUFHeader:
    """Read and check the header of the GGUF file ``path`` (only the header is read), with
    the metadata values when ``values``.

    Raises:
        pyloader.FormatError: a rule is broken (naming the file, the key or tensor, and the rule).
        pyloader.UnsupportedError: a GGUF version other than 2 or 3.
        OSError: the file cannot be opened, or is not a regular file.
    """
    path = os.fspath(path)
    with open_regular(path, "GGUF file") as f:
        size = os.fstat(f.fileno()).st_size
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    if buf is None:
        raise FormatError(f"{path}: not a GGUF file (empty)")
    # The mapping is unmapped when the last view of it goes: not closed here, as an
    # exception's traceback may still hold a view (close would raise BufferError instead).
    view = memoryview(buf)
    header = _parse(_Cursor(view, path), path, size)
    if values:
        header = dataclasses.replace(header, values=_values(_Cursor(view, path)))
    return header


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}


def _values(cur: _Cursor) -> dict[str, Any]:
    """The metadata values of a header :func:`_parse` has checked."""
    _, _, _, n_kv = cur.take("<4sIQQ", "")
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("", "key name")
        (vtype,) = cur.take("<I", key)
        out[key] = _decode(cur, vtype)
    return out


def _decode(cur: _Cursor, vtype: int) -> Any:
    if vtype in _SCALAR_FORMATS:
        return cur.take(_SCALAR_FORMATS[vtype], "")[0]
    if vtype == STRING:
        return cur.string("", "string value")
    etype, count = cur.take("<IQ", "")
    if etype in _SCALAR_FORMATS:
        dtype = np.dtype(_SCALAR_FORMATS[etype].replace("?", "u1"))
        start = cur.pos
        cur.skip(dtype.itemsize * count, "")
        arr = np.frombuffer(cur.buf, dtype, count, start)
        return [bool(v) for v in arr] if etype == 7 else arr.tolist()
    return [_decode(cur, etype) for _ in range(count)]


def _parse(cur: _Cursor, path: str, size: int) -> GGUFHeader:
    magic = bytes(cur.buf[:4])
    if magic != b"GGUF":
        raise FormatError(f"{path}: not a GGUF file (magic {magic!r})")
    if size < _HEADER_FIXED:
        raise FormatError(f"{path}: not a GGUF file ({size} bytes; the fixed header takes "
                          f"{_HEADER_FIXED})")
    _, version, n_tensors, n_kv = cur.take("<4sIQQ", "")
    if version not in (2, 3):
        raise UnsupportedError(
            f"{path}: GGUF version {version} (only little-endian versions 2 and 3 are read)")
    room = size - _HEADER_FIXED
    if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > room:
        raise FormatError(f"{path}: header declares {n_tensors} tensors and {n_kv} metadata "
                          f"keys, more than the {room} bytes after the fixed header can hold")

    value_types: dict[str, str] = {}
    nesting: dict[str, int] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}", "key name")
        where = f"metadata key {key!r}"
        if key in value_types:
            raise cur.fail(where, "duplicate key")
        (vtype,) = cur.take("<I", where)
        tname, depth, u32 = _read_value(cur, vtype, where)
        value_types[key], nesting[key] = tname, depth
        if key == "general.alignment":
            if vtype != UINT32:
                raise cur.fail(where, f"must be a uint32, not {tname}")
            if u32 == 0 or u32 & (u32 - 1):
                raise cur.fail(where, f"{u32} is not a power of two (the data alignment "
                                      "must be a positive power of two)")
            alignment = u32

    raw: list[tuple[str, int, tuple[int, ...], int]] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i}", "tensor name")
        where = f"tensor {name!r}"
        if name in seen:
            raise cur.fail(where, "duplicate tensor name")
        seen.add(name)
        (n_dims,) = cur.take("<I", where)
        if n_dims > GGML_MAX_DIMS:
            raise cur.fail(where, f"{n_dims} dimensions (GGUF allows at most {GGML_MAX_DIMS})")
        dims = cur.take(f"<{n_dims}Q", where) if n_dims else ()
        type_id, rel = cur.take("<IQ", where)
        raw.append((name, type_id, dims, rel))
    header_end = cur.pos
    data_offset = header_end + (-header_end % alignment)

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, type_id, dims, rel in raw:
        where = f"tensor {name!r}"
        if type_id not in GGML_TYPES:
            raise cur.fail(where, f"unknown ggml type {type_id}")
        tname, block, block_bytes = GGML_TYPES[type_id]
        for d in dims:
            if d > _INT64_MAX:
                raise cur.fail(where, f"dimension {d} is above 2**63-1")
        elements = math.prod(dims)
        if elements > _INT64_MAX:
            raise cur.fail(where, f"shape {tuple(reversed(dims))} has {elements} elements, "
                                  "above 2**63-1")
        row = dims[0] if dims else 1
        if row % block:
            raise cur.fail(where, f"{tname} stores blocks of {block} elements, but a row "
                                  f"(innermost dimension) has {row}")
        nbytes = elements // block * block_bytes
        if rel % alignment:
            raise cur.fail(where, f"data offset {rel} is not a multiple of the alignment "
                                  f"{alignment}")
        start = data_offset + rel
        if start + nbytes > size:
            raise cur.fail(where, f"data [{start}, {start + nbytes}) ends past the end of "
                                  f"the file ({size} bytes)")
        tensors[name] = GGUFTensorInfo(name, type_id, tname, tuple(reversed(dims)), start,
                                       nbytes)
    prev: GGUFTensorInfo | None = None
    for t in sorted(tensors.values(), key=lambda t: t.offset):
        if t.nbytes == 0:
            continue
        if prev is not None and t.offset < prev.offset + prev.nbytes:
            raise cur.fail(f"tensor {t.name!r}", f"data overlaps tensor {prev.name!r}")
        prev = t
    return GGUFHeader(path, version, value_types, nesting, alignment, data_offset, tensors,
                      size)
