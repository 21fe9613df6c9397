"""Build safetensors files byte by byte, valid or not, for the format-rule tests.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header +
the data section. Nothing here validates anything: the point is to write
exactly the bytes a test asks for.
"""

from __future__ import annotations

import json
import struct
from typing import Iterable, Sequence

U64_MAX = (1 << 64) - 1


def st(header: bytes | str, data: bytes = b"", *, length: int | None = None) -> bytes:
    """The file ``len(header) | header | data``; ``length`` overrides the
    8-byte length field (it may lie about the header or exceed 2**63)."""
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def entry(dtype: str, shape: Sequence[int], begin: int, end: int) -> str:
    """One tensor entry as compact JSON text (numbers written exactly)."""
    dims = ",".join(str(d) for d in shape)
    return f'{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{begin},{end}]}}'


def build(tensors: Iterable[tuple[str, str, Sequence[int], bytes]],
          metadata: dict[str, str] | None = None, *, lead: bytes = b"",
          trail: bytes = b"") -> bytes:
    """A valid file: ``(name, dtype, shape, raw bytes)`` stored back to back in
    the given order, optional ``__metadata__``, and the header wrapped in the
    ``lead``/``trail`` bytes (JSON whitespace keeps it valid)."""
    parts = []
    if metadata is not None:
        parts.append('"__metadata__":' + json.dumps(metadata, separators=(",", ":")))
    data = b""
    for name, dtype, shape, raw in tensors:
        parts.append(json.dumps(name) + ":" + entry(dtype, shape, len(data), len(data) + len(raw)))
        data += raw
    header = lead + ("{" + ",".join(parts) + "}").encode() + trail
    return st(header, data)


def index(weight_map: dict[str, str], metadata: dict | None = None) -> bytes:
    """A ``model.safetensors.index.json`` body."""
    return json.dumps({"metadata": metadata or {}, "weight_map": weight_map}).encode()
