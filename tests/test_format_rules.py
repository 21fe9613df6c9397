"""One test per safetensors format rule, each from a hand-written byte string.

The rules are listed in docs/format-rules.md (and ../shared/STYLE.md). Every
negative case asserts the exception type, the file the message names, the
tensor it names (when the rule is about a tensor) and a distinctive piece of
the rule text. The positive cases sit right next to the rules they border,
so a reader that rejected too much fails as surely as one that accepted too
much.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import pytest

import pyloader
from stbytes import U64_MAX, build, entry, index, st

LOAD_STRATEGIES = ("mmap", "pread", "mlx")

# A valid one-tensor header and its data: most cases break exactly one thing
# in a copy of these.
W_ENTRY = b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
W_HEADER = b"{" + W_ENTRY + b"}"
W_DATA = bytes(8)


def nest(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


def shard_a() -> bytes:
    return build([("a", "F32", [2], np.array([1.5, -2.0], np.float32).tobytes())])


def shard_b() -> bytes:
    return build([("b", "U8", [3], b"abc")])


FileContent = bytes | Callable[[Path], bytes]


@dataclass
class Case:
    id: str
    files: dict[str, FileContent]  # relative path -> bytes (or bytes built from tmp_path)
    rule: str | tuple[str, ...]    # substring(s) of the message; "{root}" is tmp_path
    tensor: str | None = None      # the tensor the message must name
    open: str = "m.safetensors"    # what pyloader.open gets (relative to tmp_path)
    names: str = "m.safetensors"   # the file the message must start with
    rules: tuple[int, ...] = field(default=())  # STYLE.md rule numbers (for the docs table)


def one(id: str, data: bytes, rule, tensor: str | None = None, *, r: int) -> Case:
    """A single-file case."""
    return Case(id, {"m.safetensors": data}, rule, tensor, rules=(r,))


IDX = "model/model.safetensors.index.json"


def sharded(id: str, index_body: FileContent, rule, tensor: str | None = None, *,
            names: str = IDX, shards: dict[str, FileContent] | None = None) -> Case:
    # A valid file just outside the model directory: a weight_map path that
    # escapes would find it and load instead of failing.
    files = {IDX: index_body, "a.safetensors": shard_a()}
    files.update({f"model/{k}": v for k, v in (shards or {"a.safetensors": shard_a(),
                                                          "b.safetensors": shard_b()}).items()})
    return Case(id, files, rule, tensor, open="model", names=names, rules=(10,))


CASES = [
    # --- Rule 1: at least the 8-byte length field --------------------------------
    one("r1-empty-file", b"", "file is 0 bytes, too small for the 8-byte header length", r=1),
    one("r1-seven-bytes", b"\x02\x00\x00\x00\x00\x00\x00",
        "file is 7 bytes, too small for the 8-byte header length", r=1),
    # --- Rule 2: N <= 100,000,000 ------------------------------------------------------
    one("r2-header-len-over-100MB", st(b"{}", length=100_000_001),
        "header length 100000001 exceeds the limit of 100000000 bytes", r=2),
    one("r2-header-len-2^63", st(b"{}", length=1 << 63),
        "header length 9223372036854775808 exceeds the limit", r=2),
    one("r2-header-len-u64-max", st(b"{}", length=U64_MAX),  # 8 + N would wrap to 7
        "header length 18446744073709551615 exceeds the limit", r=2),
    # --- Rule 3: 8 + N <= file size ----------------------------------------------------
    one("r3-header-len-past-eof", st(b"{}", length=100),
        "header length 100 runs past the end of the 10-byte file", r=3),
    one("r3-header-len-one-past-eof", st(b"{}", length=3),
        "header length 3 runs past the end of the 10-byte file", r=3),
    one("r3-header-only-length-field", st(b"", length=2),
        "header length 2 runs past the end of the 8-byte file", r=3),
    # --- Rule 4: UTF-8 ----------------------------------------------------------------------
    one("r4-utf8-overlong-slash", st(b'{"__metadata__":{"\xc0\xaf":"x"}}'),
        "header is not valid UTF-8", r=4),
    one("r4-utf8-overlong-3byte", st(b'{"__metadata__":{"\xe0\x80\xaf":"x"}}'),
        "header is not valid UTF-8", r=4),
    one("r4-utf8-encoded-surrogate", st(b'{"__metadata__":{"\xed\xa0\x80":"x"}}'),
        "header is not valid UTF-8", r=4),
    one("r4-utf8-truncated-multibyte", st(b'{"__metadata__":{"a":"\xe2\x82"}}'),
        "header is not valid UTF-8", r=4),
    one("r4-utf8-truncated-at-end", st(b'{}\xf0\x9f\x98'), "header is not valid UTF-8", r=4),
    one("r4-utf8-above-u10ffff", st(b'{"__metadata__":{"a":"\xf4\x90\x80\x80"}}'),
        "header is not valid UTF-8", r=4),
    one("r4-utf8-lone-continuation", st(b'{"__metadata__":{"a":"\x80"}}'),
        "header is not valid UTF-8", r=4),
    one("r4-utf8-latin1-byte", st(b'{"__metadata__":{"a":"caf\xe9"}}'),
        "header is not valid UTF-8", r=4),
    # --- Rule 4: JSON ------------------------------------------------------------------------
    one("r4-json-empty-header", st(b""), "header is not valid JSON: unexpected end of JSON", r=4),
    one("r4-json-whitespace-only", st(b"   "), "header is not valid JSON: unexpected end", r=4),
    one("r4-json-trailing-comma", st(b"{" + W_ENTRY + b",}", W_DATA),
        "header is not valid JSON: expected a string key", r=4),
    one("r4-json-single-quotes", st(b"{'__metadata__':{'a':'b'}}"),
        "header is not valid JSON: expected a string key at byte 1", r=4),
    one("r4-json-single-quoted-value", st(b"{\"__metadata__\":{\"a\":'b'}}"),
        "header is not valid JSON: unexpected character '''", r=4),
    one("r4-json-unterminated-string", st(b'{"__metadata__":{"a":"b}}'),
        "header is not valid JSON: unterminated string", r=4),
    one("r4-json-garbage-after-value", st(W_HEADER + b"x", W_DATA),
        "header is not valid JSON: unexpected data after the JSON value", r=4),
    one("r4-json-second-object", st(b"{}{}"),
        "header is not valid JSON: unexpected data after the JSON value", r=4),
    one("r4-json-nul-padding", st(W_HEADER + b"\x00\x00", W_DATA),
        "header is not valid JSON: unexpected data after the JSON value", r=4),
    one("r4-json-nan", st(b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', W_DATA),
        "header is not valid JSON: unexpected character 'N'", r=4),
    one("r4-json-infinity", st(b'{"__metadata__":{"a":Infinity}}'),
        "header is not valid JSON: unexpected character 'I'", r=4),
    one("r4-json-leading-zero", st(b'{"w":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}}',
                                   W_DATA), "header is not valid JSON: expected ',' or ']'", r=4),
    one("r4-json-control-char-in-key",
        st(b'{"a\nb":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}', b"\x00"),
        "header is not valid JSON: control character in string", r=4),
    one("r4-json-invalid-escape", st(b'{"__metadata__":{"a":"\\x41"}}'),
        "header is not valid JSON: invalid escape", r=4),
    one("r4-json-unpaired-surrogate-escape", st(b'{"__metadata__":{"\\ud800":"x"}}'),
        "header is not valid JSON: unpaired surrogate escape", r=4),
    one("r4-json-reversed-surrogate-pair", st(b'{"__metadata__":{"\\ude00\\ud83d":"x"}}'),
        "header is not valid JSON: unpaired surrogate escape", r=4),
    one("r4-json-form-feed-is-not-whitespace", st(b"\x0c{}"),
        "header is not valid JSON: unexpected byte 0x0C at byte 0", r=4),
    # Valid UTF-8 that is not JSON: the offending byte is named in hex, so the
    # message stays valid UTF-8 (quoting half a character once made Python
    # raise UnicodeDecodeError instead of FormatError).
    one("r4-json-utf8-bom", st(b"\xef\xbb\xbf{}"),
        "header is not valid JSON: unexpected byte 0xEF at byte 0", r=4),
    one("r4-json-non-ascii-value", st('{"__metadata__":{"a":é}}'.encode()),
        "header is not valid JSON: unexpected byte 0xC3", r=4),
    one("r4-json-nesting-bomb-arrays", st(b'{"__metadata__":{"a":' + nest(10_000) + b"}}"),
        "header is not valid JSON: nesting deeper than 64", r=4),
    one("r4-json-nesting-bomb-objects",
        st(b'{"__metadata__":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001),
        "header is not valid JSON: nesting deeper than 64", r=4),
    one("r4-json-nesting-bomb-unclosed", st(b"[" * 1_000_000),
        "header is not valid JSON: nesting deeper than 64", r=4),
    one("r4-header-top-level-array", st(b"[]"), "header must be a JSON object, got an array", r=4),
    one("r4-header-top-level-null", st(b"null"), "header must be a JSON object, got null", r=4),
    # --- Rule 5: __metadata__ str -> str; duplicate keys -------------------------------------
    one("r5-duplicate-tensor-key",
        st(b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
           b'"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab"),
        "header is not valid JSON: duplicate key 'w'", r=5),
    one("r5-duplicate-tensor-key-escaped",
        st(b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
           b'"\\u0077":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab"),
        "header is not valid JSON: duplicate key 'w'", r=5),
    one("r5-duplicate-key-in-entry",
        st(b'{"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', W_DATA),
        "header is not valid JSON: duplicate key 'dtype'", r=5),
    one("r5-duplicate-metadata-key", st(b'{"__metadata__":{"a":"1","a":"2"}}'),
        "header is not valid JSON: duplicate key 'a'", r=5),
    one("r5-duplicate-metadata-block", st(b'{"__metadata__":{"a":"1"},"__metadata__":{}}'),
        "header is not valid JSON: duplicate key '__metadata__'", r=5),
    one("r5-metadata-string", st(b'{"__metadata__":"format=pt"}'),
        "__metadata__ must be an object, got a string", r=5),
    one("r5-metadata-array", st(b'{"__metadata__":[]}'),
        "__metadata__ must be an object, got an array", r=5),
    one("r5-metadata-number", st(b'{"__metadata__":0}'),
        "__metadata__ must be an object, got a number", r=5),
    one("r5-metadata-value-number", st(b'{"__metadata__":{"format":"pt","step":100}}'),
        "__metadata__ value of 'step' must be a string, got a number", r=5),
    one("r5-metadata-value-object", st(b'{"__metadata__":{"cfg":{"a":"b"}}}'),
        "__metadata__ value of 'cfg' must be a string, got an object", r=5),
    one("r5-metadata-value-null", st(b'{"__metadata__":{"a":null}}'),
        "__metadata__ value of 'a' must be a string, got null", r=5),
    # --- Rule 6: dtype, shape, data_offsets ----------------------------------------------------
    one("r6-entry-array", st(b'{"w":["F32",[2],[0,8]]}', W_DATA),
        "tensor entry must be a JSON object, got an array", "w", r=6),
    one("r6-entry-string", st(b'{"w":"F32"}'),
        "tensor entry must be a JSON object, got a string", "w", r=6),
    one("r6-missing-dtype", st(b'{"w":{"shape":[2],"data_offsets":[0,8]}}', W_DATA),
        "missing field 'dtype'", "w", r=6),
    one("r6-missing-shape", st(b'{"w":{"dtype":"F32","data_offsets":[0,8]}}', W_DATA),
        "missing field 'shape'", "w", r=6),
    one("r6-missing-data-offsets", st(b'{"w":{"dtype":"F32","shape":[2]}}', W_DATA),
        "missing field 'data_offsets'", "w", r=6),
    one("r6-unknown-field",
        st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"stride":[1]}}', W_DATA),
        "unexpected field 'stride'", "w", r=6),
    one("r6-unknown-dtype", st(b'{"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}',
                               bytes(16)), "unknown dtype 'F128'", "w", r=6),
    one("r6-lowercase-dtype", st(b'{"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}',
                                 W_DATA), "unknown dtype 'f32'", "w", r=6),
    one("r6-torch-dtype-name", st(b'{"w":{"dtype":"float32","shape":[2],"data_offsets":[0,8]}}',
                                  W_DATA), "unknown dtype 'float32'", "w", r=6),
    one("r6-dtype-number", st(b'{"w":{"dtype":32,"shape":[2],"data_offsets":[0,8]}}', W_DATA),
        "'dtype' must be a string, got a number", "w", r=6),
    one("r6-shape-number", st(b'{"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}}', W_DATA),
        "'shape' must be an array, got a number", "w", r=6),
    one("r6-negative-dim", st(b'{"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', W_DATA),
        "'shape' must hold non-negative integers, got -2", "w", r=6),
    one("r6-negative-zero-dim",
        st(b'{"w":{"dtype":"F32","shape":[-0,2],"data_offsets":[0,0]}}'),
        "'shape' must hold non-negative integers, got -0", "w", r=6),
    one("r6-float-dim", st(b'{"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', W_DATA),
        "'shape' must hold non-negative integers, got 2.0", "w", r=6),
    one("r6-exponent-dim",
        st(b'{"w":{"dtype":"U8","shape":[1e3],"data_offsets":[0,1000]}}', bytes(1000)),
        "'shape' must hold non-negative integers, got 1e3", "w", r=6),
    one("r6-string-dim", st(b'{"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}', W_DATA),
        "'shape' must hold non-negative integers, got a string", "w", r=6),
    one("r6-dim-beyond-u64",
        st(b'{"w":{"dtype":"U8","shape":[18446744073709551616,0],"data_offsets":[0,0]}}'),
        "'shape' must hold non-negative integers, got 18446744073709551616", "w", r=6),
    one("r6-offsets-one-number", st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[8]}}',
                                    W_DATA), "'data_offsets' must be an array [begin, end]", "w",
        r=6),
    one("r6-offsets-three-numbers",
        st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', W_DATA),
        "'data_offsets' must be an array [begin, end]", "w", r=6),
    one("r6-offsets-object",
        st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":{"begin":0,"end":8}}}', W_DATA),
        "'data_offsets' must be an array [begin, end]", "w", r=6),
    one("r6-negative-offset", st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}',
                                 W_DATA), "'data_offsets' must hold non-negative integers, got -8",
        "w", r=6),
    one("r6-float-offset", st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}}',
                              W_DATA), "'data_offsets' must hold non-negative integers, got 8.0",
        "w", r=6),
    one("r6-null-offset", st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,null]}}',
                             W_DATA), "'data_offsets' must hold non-negative integers, got null",
        "w", r=6),
    # --- Rule 7: contiguous from 0, no holes, no overlap ------------------------------------
    one("r7-end-before-begin", st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}',
                                  W_DATA), "data_offsets end 0 is before begin 8", "w", r=7),
    one("r7-hole-at-start", st(b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', W_DATA),
        "hole in the data section: tensor begins at 4 but the data section starts at 0", "w",
        r=7),
    one("r7-hole-between-tensors",
        st(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
           b'"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', bytes(12)),
        "hole in the data section: tensor begins at 8 but the previous tensor 'a' ends at 4",
        "b", r=7),
    one("r7-overlap",
        st(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
           b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', bytes(12)),
        "overlap in the data section: tensor begins at 4 but the previous tensor 'a' ends at 8",
        "b", r=7),
    one("r7-same-range-twice",
        st(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
           b'"b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}', W_DATA),
        "overlap in the data section: tensor begins at 0 but the previous tensor 'a' ends at 8",
        "b", r=7),
    one("r7-empty-tensor-inside-another",
        st(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
           b'"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}', W_DATA),
        "overlap in the data section: tensor begins at 4 but the previous tensor 'a' ends at 8",
        "e", r=7),
    # --- Rule 8: checked element and byte counts -------------------------------------------------
    one("r8-shape-byte-mismatch", st(b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}',
                                     W_DATA),
        "data_offsets [0, 8] span 8 bytes but F32 with shape [3] needs 12", "w", r=8),
    one("r8-dtype-byte-mismatch", st(b'{"w":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}}',
                                     W_DATA),
        "data_offsets [0, 8] span 8 bytes but F64 with shape [2] needs 16", "w", r=8),
    one("r8-scalar-needs-one-element",
        st(b'{"w":{"dtype":"F32","shape":[],"data_offsets":[0,0]}}'),
        "data_offsets [0, 0] span 0 bytes but F32 with shape [] needs 4", "w", r=8),
    one("r8-zero-dim-but-bytes", st(b'{"w":{"dtype":"F32","shape":[0,2],"data_offsets":[0,8]}}',
                                    W_DATA),
        "span 8 bytes but F32 with shape [0, 2] needs 0", "w", r=8),
    one("r8-element-count-overflow",
        st(b'{"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}}'),
        "element count of shape [4294967296, 4294967296] overflows 64 bits", "w", r=8),
    one("r8-element-count-overflow-before-zero-dim",
        st(b'{"w":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}'),
        "element count of shape [4294967296, 4294967296, 0] overflows 64 bits", "w", r=8),
    one("r8-bit-size-overflow",
        st(b'{"w":{"dtype":"F32","shape":[2305843009213693952],"data_offsets":[0,0]}}'),
        "bit size of shape [2305843009213693952] overflows 64 bits", "w", r=8),
    one("r8-wrapping-byte-count",  # 2^62 F32 = 2^64 bytes: a wrapping 64-bit count says 0
        st(b'{"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}}'),
        "bit size of shape [4611686018427387904] overflows 64 bits", "w", r=8),
    one("r8-f4-odd-element-count", st(b'{"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}',
                                      b"\x00\x00"),
        "size of 3 F4 elements is not a whole number of bytes", "w", r=8),
    one("r8-f6-partial-byte", st(b'{"w":{"dtype":"F6_E2M3","shape":[3],"data_offsets":[0,3]}}',
                                 b"\x00\x00\x00"),
        "size of 3 F6_E2M3 elements is not a whole number of bytes", "w", r=8),
    # --- Rule 9: data ends exactly at the end of the file ----------------------------------------
    one("r9-trailing-byte", st(W_HEADER, W_DATA + b"\x00"),
        (f"tensor data ends at byte {8 + len(W_HEADER) + 8} but the file has "
         f"{8 + len(W_HEADER) + 9} bytes (trailing bytes)"), r=9),
    one("r9-truncated-data", st(W_HEADER, W_DATA[:5]),
        (f"tensor data ends at byte {8 + len(W_HEADER) + 8} but the file has "
         f"{8 + len(W_HEADER) + 5} bytes (truncated file)"), r=9),
    one("r9-no-data-at-all", st(W_HEADER), "(truncated file)", r=9),
    one("r9-empty-header-trailing-byte", st(b"{}", b"\x00"),
        "tensor data ends at byte 10 but the file has 11 bytes (trailing bytes)", r=9),
    one("r9-data-end-overflows-u64",  # 16 chained 2^60-byte tensors end at 2^64 - 1
        st("{" + ",".join(f'"t{k:02d}":' + entry("U8", [(1 << 60) - (k == 15)], k << 60,
                                                   ((k + 1) << 60) - (k == 15))
                          for k in range(16)) + "}"),
        "tensor data ends at byte (overflow)", r=9),
    # --- Sharded index (model.safetensors.index.json) ---------------------------------------
    sharded("idx-weight-map-names-missing-tensor",
            index({"a": "a.safetensors", "ghost": "a.safetensors", "b": "b.safetensors"}),
            "weight_map names this tensor in 'a.safetensors' but that file does not contain it",
            "ghost"),
    sharded("idx-tensor-missing-from-weight-map", index({"a": "a.safetensors"}),
            "tensor is stored in a shard but missing from {root}/" + IDX, "a2",
            names="model/a.safetensors",
            shards={"a.safetensors": build([("a", "F32", [2], bytes(8)),
                                            ("a2", "U8", [1], b"x")])}),
    sharded("idx-tensor-in-other-shard", index({"a": "b.safetensors", "b": "a.safetensors"}),
            "weight_map names this tensor in 'b.safetensors' but it is stored in "
            "{root}/model/a.safetensors", "a"),
    sharded("idx-path-dotdot", index({"a": "../a.safetensors"}),
            "weight_map file '../a.safetensors' is not a relative path inside the model directory",
            "a"),
    sharded("idx-path-dotdot-inner", index({"a": "x/../../a.safetensors"}),
            "weight_map file 'x/../../a.safetensors' is not a relative path", "a"),
    sharded("idx-path-absolute",
            lambda root: index({"a": str(root / "a.safetensors")}),
            "weight_map file '{root}/a.safetensors' is not a relative path", "a"),
    sharded("idx-path-empty", index({"a": ""}),
            "weight_map file '' is not a relative path", "a"),
    sharded("idx-weight-map-value-number", b'{"weight_map":{"a":1}}',
            "weight_map value must be a file name string", "a"),
    sharded("idx-not-json", b'{"weight_map":{"a":"a.safetensors",}}', "index is not valid JSON"),
    sharded("idx-empty-file", b"", "index is not valid JSON: unexpected end of JSON"),
    sharded("idx-not-utf8", b'{"weight_map":{"\xff":"a.safetensors"}}',
            "index is not valid UTF-8"),
    sharded("idx-non-ascii-value", '{"weight_map":ä}'.encode(),
            "index is not valid JSON: unexpected byte 0xC3"),
    sharded("idx-top-level-array", b'["a.safetensors"]', "index must be a JSON object"),
    sharded("idx-weight-map-missing", b'{"metadata":{"total_size":8}}',
            "index has no 'weight_map' object"),
    sharded("idx-weight-map-array", b'{"weight_map":["a.safetensors"]}',
            "index has no 'weight_map' object"),
    sharded("idx-duplicate-weight-map-key",
            b'{"weight_map":{"a":"a.safetensors","a":"a.safetensors"}}',
            "index is not valid JSON: duplicate key 'a'"),
    sharded("idx-nesting-bomb", b'{"metadata":' + nest(10_000) + b',"weight_map":{}}',
            "index is not valid JSON: nesting deeper than 64"),
    sharded("idx-shard-breaks-a-rule", index({"a": "a.safetensors"}),
            "(trailing bytes)", names="model/a.safetensors",
            shards={"a.safetensors": shard_a() + b"\x00"}),
    Case("dir-duplicate-tensor-across-files",
         {"model/a.safetensors": build([("w", "F32", [2], bytes(8))]),
          "model/b.safetensors": build([("w", "U8", [1], b"x")])},
         "tensor name also present in {root}/model/a.safetensors", "w", open="model",
         names="model/b.safetensors", rules=(10,)),
    Case("dir-one-file-breaks-a-rule",
         {"model/a.safetensors": shard_a(), "model/b.safetensors": shard_b()[:-1]},
         "(truncated file)", open="model", names="model/b.safetensors", rules=(10,)),
]


def write_files(root: Path, files: dict[str, FileContent]) -> None:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content(root) if callable(content) else content)


def test_case_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_violation(case: Case, tmp_path: Path):
    write_files(tmp_path, case.files)
    path = tmp_path / case.open
    rules = (case.rule,) if isinstance(case.rule, str) else case.rule
    rules = tuple(r.replace("{root}", str(tmp_path)) for r in rules)
    prefix = str(tmp_path / case.names) + ": "
    if case.tensor is not None:
        prefix += f"tensor '{case.tensor}': "

    with pytest.raises(pyloader.FormatError) as info:
        pyloader.open(path)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(path) in msg
    assert msg.startswith(prefix), msg
    for r in rules:
        assert r in msg, msg
    if case.tensor is None:  # a file-level rule: the rule text follows the file directly
        assert not msg[len(prefix):].startswith("tensor '"), msg

    # Every loading strategy validates first and fails the same way.
    for strategy in LOAD_STRATEGIES:
        with pytest.raises(pyloader.FormatError) as again:
            pyloader.load(path, strategy)
        assert str(again.value) == msg


# --- Errors that are not format errors ------------------------------------------------------

def test_missing_file_is_file_not_found(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        pyloader.open(tmp_path / "nope.safetensors")


def test_directory_without_safetensors_is_file_not_found(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("no weights here")
    with pytest.raises(FileNotFoundError):
        pyloader.open(tmp_path)


def test_index_naming_a_missing_shard_is_file_not_found(tmp_path: Path):
    write_files(tmp_path, {IDX: index({"a": "a.safetensors", "b": "gone.safetensors"}),
                           "model/a.safetensors": shard_a()})
    with pytest.raises(FileNotFoundError) as info:
        pyloader.open(tmp_path / "model")
    assert "gone.safetensors" in str(info.value)


def test_unknown_tensor_name_is_key_error(tmp_path: Path):
    p = tmp_path / "m.safetensors"
    p.write_bytes(shard_a())
    ckpt = pyloader.open(p)
    assert "a" in ckpt and "nope" not in ckpt
    with pytest.raises(KeyError, match="nope"):
        ckpt["nope"]
    for strategy in LOAD_STRATEGIES:
        with pytest.raises(KeyError, match="nope"):
            pyloader.load(p, strategy, names=["nope"])


# --- Inputs that border a rule and must load -----------------------------------------------

def _open_and_load(path: Path) -> tuple[pyloader.Checkpoint, dict[str, dict[str, mx.array]]]:
    ckpt = pyloader.open(path)
    return ckpt, {s: pyloader.load(path, s) for s in ("mmap", "pread")}


def raw(a: mx.array) -> bytes:
    return bytes(memoryview(a.reshape(-1).view(mx.uint8))) if a.size else b""


F32_2 = np.array([1.5, -2.25], np.float32).tobytes()

VALID = [
    ("padded-leading-spaces", st(b"    " + W_HEADER, F32_2), {"w": ("F32", (2,))}),
    ("padded-trailing-spaces", st(W_HEADER + b"       ", F32_2), {"w": ("F32", (2,))}),
    ("padded-all-json-whitespace", st(b" \t\r\n" + W_HEADER + b"\n\r\t ", F32_2),
     {"w": ("F32", (2,))}),
    ("empty-header", st(b"{}"), {}),
    ("only-metadata", st(b'{"__metadata__":{"format":"pt","empty":""}}'), {}),
    ("empty-metadata", st(b'{"__metadata__":{}}'), {}),
    ("null-metadata", st(b'{"__metadata__":null}'), {}),  # what MLX writes; safetensors: None
    ("scalar-shape", st(b'{"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}',
                        np.float32(3.5).tobytes()), {"s": ("F32", ())}),
    ("zero-sized-dim", st(b'{"e":{"dtype":"F32","shape":[2,0,3],"data_offsets":[0,0]}}'),
     {"e": ("F32", (2, 0, 3))}),
    ("zero-sized-at-end",
     st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"e":{"dtype":"I64","shape":[0],"data_offsets":[8,8]}}', F32_2),
     {"w": ("F32", (2,)), "e": ("I64", (0,))}),
    ("zero-sized-at-start-of-next",
     st(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"e":{"dtype":"I64","shape":[0],"data_offsets":[0,0]}}', F32_2),
     {"w": ("F32", (2,)), "e": ("I64", (0,))}),
    ("zero-dim-with-huge-dim",  # 0 first: the checked product never overflows
     st(b'{"e":{"dtype":"U8","shape":[0,18446744073709551615],"data_offsets":[0,0]}}'),
     {"e": ("U8", (0, U64_MAX))}),
    ("entries-out-of-offset-order",
     st(b'{"b":{"dtype":"U8","shape":[2],"data_offsets":[8,10]},'
        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', F32_2 + b"xy"),
     {"a": ("F32", (2,)), "b": ("U8", (2,))}),
    ("surrogate-pair-escape-name",
     st(b'{"\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x07"),
     {"\U0001F600": ("U8", (1,))}),
    ("utf8-name-and-metadata",
     st('{"__metadata__":{"note":"ünïcode"},"é.w":{"dtype":"U8","shape":[1],'
        '"data_offsets":[0,1]}}'.encode(), b"\x07"), {"é.w": ("U8", (1,))}),
    ("nul-in-name", st(b'{"a\\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                       b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\x07\x08"),
     {"a\x00b": ("U8", (1,)), "a": ("U8", (1,))}),
    ("escaped-name", st(b'{"a\\"b\\\\c\\/d\\u0041":{"dtype":"U8","shape":[1],'
                        b'"data_offsets":[0,1]}}', b"\x07"), {'a"b\\c/dA': ("U8", (1,))}),
    ("whitespace-inside-arrays", st(b'{"w":{"dtype":"F32","shape":[ 2 ],'
                                     b'"data_offsets":[ 0 , 8 ]}}', F32_2), {"w": ("F32", (2,))}),
    ("f4-even-count", st(b'{"q":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}', b"\x12" * 3),
     {"q": ("F4", (2, 3))}),
    ("f6-whole-bytes", st(b'{"q":{"dtype":"F6_E3M2","shape":[4],"data_offsets":[0,3]}}',
                          b"\x12" * 3), {"q": ("F6_E3M2", (4,))}),
]


@pytest.mark.parametrize("data,expected", [v[1:] for v in VALID], ids=[v[0] for v in VALID])
def test_valid_file_opens(data: bytes, expected: dict, tmp_path: Path):
    p = tmp_path / "m.safetensors"
    p.write_bytes(data)
    ckpt = pyloader.open(p)
    assert {n: (ckpt[n].dtype, ckpt[n].shape) for n in ckpt.keys()} == expected
    header_n = int.from_bytes(data[:8], "little")
    offset = 8 + header_n
    for meta in sorted(ckpt.tensors(), key=lambda m: (m.offset, m.nbytes)):
        assert meta.offset == offset
        offset += meta.nbytes
    assert offset == len(data)

    loadable = [n for n in expected if not expected[n][0].startswith(("F4", "F6"))
                and all(d < 2**31 for d in expected[n][1])]
    for strategy in ("mmap", "pread"):
        if len(loadable) < len(expected):
            with pytest.raises(pyloader.UnsupportedError):
                pyloader.load(p, strategy)
        if not loadable:
            continue  # names=[] means "all tensors"
        got = pyloader.load(p, strategy, names=loadable)
        assert sorted(got) == sorted(loadable)
        for n in loadable:
            m = ckpt[n]
            assert tuple(got[n].shape) == m.shape
            assert raw(got[n]) == data[m.offset:m.offset + m.nbytes]


def test_metadata_is_returned(tmp_path: Path):
    p = tmp_path / "m.safetensors"
    p.write_bytes(st('{"__metadata__":{"format":"pt","note":"ünï \\"q\\""}}'.encode()))
    assert pyloader.open(p).metadata() == {"format": "pt", "note": 'ünï "q"'}


def test_header_at_exact_size_limit_opens(tmp_path: Path):
    """N == 100,000,000 is allowed (rule 2 rejects only N > limit)."""
    p = tmp_path / "m.safetensors"
    with open(p, "wb") as f:
        f.write((100_000_000).to_bytes(8, "little") + b"{}")
        f.write(b" " * (100_000_000 - 2))
    try:
        assert len(pyloader.open(p)) == 0
    finally:
        p.unlink()


def test_valid_sharded_and_plain_directories_load(tmp_path: Path):
    """The controls for the idx-*/dir-* cases: the same shards, consistent, load."""
    write_files(tmp_path, {IDX: index({"a": "a.safetensors", "b": "b.safetensors"},
                                      {"total_size": 11}),
                           "model/a.safetensors": shard_a(), "model/b.safetensors": shard_b(),
                           "plain/a.safetensors": shard_a(), "plain/b.safetensors": shard_b()})
    for d in ("model", "plain"):
        for strategy in LOAD_STRATEGIES:
            got = pyloader.load(tmp_path / d, strategy)
            assert got["a"].tolist() == [1.5, -2.0]
            assert bytes(np.array(got["b"])) == b"abc"


# --- All dtypes against a reference --------------------------------------------------------

def _all_dtype_tensors() -> list[tuple[str, str, list[int], bytes, str | None]]:
    """(name, safetensors dtype, shape, bytes, numpy dtype for the bytes)."""
    rng = np.random.default_rng(7)
    specs = [("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("U16", "uint16"),
             ("I16", "int16"), ("U32", "uint32"), ("I32", "int32"), ("U64", "uint64"),
             ("I64", "int64"), ("F16", "float16"), ("BF16", None), ("F32", "float32"),
             ("F64", "float64"), ("C64", "complex64"), ("F8_E4M3", None), ("F8_E5M2", None),
             ("F8_E8M0", None)]
    out = [("odd", "U8", [3], b"\x01\x02\x03", "uint8")]  # makes what follows misaligned
    for st_name, np_name in specs:
        for shape in ([], [0], [5], [2, 3]):
            n = int(np.prod(shape)) if shape else 1
            if np_name == "bool":
                data = rng.integers(0, 2, n).astype(np.bool_).tobytes()
            elif np_name in ("float16", "float32", "float64"):
                data = rng.standard_normal(n).astype(np_name).tobytes()
            elif np_name == "complex64":
                data = rng.standard_normal(2 * n).astype(np.float32).tobytes()
            elif np_name is not None:
                info = np.iinfo(np_name)
                data = rng.integers(info.min, info.max, n, dtype=np_name, endpoint=True).tobytes()
            elif st_name == "BF16":  # finite bf16 bit patterns
                data = (rng.integers(0, 1 << 16, n, dtype=np.uint16) & 0xBFFF).tobytes()
            else:  # fp8: raw bytes
                data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            name = f"{st_name}.{'x'.join(map(str, shape)) or 'scalar'}"
            out.append((name, st_name, shape, data, np_name))
    return out


# Dtypes mx.load (MLX 0.32) cannot read: compared with a numpy decode instead.
NOT_IN_MX_LOAD = ("F64", "F8_E5M2")


def test_all_dtypes_match_mx_load(tmp_path: Path):
    tensors = _all_dtype_tensors()
    p = tmp_path / "mx.safetensors"
    p.write_bytes(build([(n, d, s, b) for n, d, s, b, _ in tensors
                         if d not in NOT_IN_MX_LOAD], {"format": "mlx"}))
    ref = mx.load(str(p))
    assert len(ref) == 1 + 15 * 4
    for strategy in LOAD_STRATEGIES:
        got = pyloader.load(p, strategy)
        assert sorted(got) == sorted(ref)
        for n, a in ref.items():
            assert got[n].dtype == a.dtype, n
            assert got[n].shape == a.shape, n
            assert mx.array_equal(got[n], a).item(), (strategy, n)
            assert raw(got[n]) == raw(a), (strategy, n)
    assert not all(m.aligned for m in pyloader.open(p).tensors())  # misaligned path covered

    q = tmp_path / "np.safetensors"
    rest = [t for t in tensors if t[1] in NOT_IN_MX_LOAD]
    q.write_bytes(build([("odd", "U8", [3], b"\x01\x02\x03")] +
                        [(n, d, s, b) for n, d, s, b, _ in rest]))
    for strategy in ("mmap", "pread"):
        got = pyloader.load(q, strategy)
        for n, d, shape, data, np_name in rest:
            assert got[n].shape == tuple(shape)
            assert raw(got[n]) == data, (strategy, n)
            if np_name:
                assert np.array_equal(np.array(got[n]), np.frombuffer(data, np_name).reshape(shape))


# --- Robustness: truncations and random mutations never crash --------------------------------

ROBUSTNESS_SCRIPT = textwrap.dedent(r'''
    import os, random, sys
    import mlx.core as mx
    import pyloader

    base_path, work, count, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    base = open(base_path, "rb").read()
    rng = random.Random(seed)
    cases = [("prefix", str(k), base[:k]) for k in range(len(base))]
    for _ in range(count):
        pos = rng.randrange(len(base))
        val = rng.choice([b for b in range(256) if b != base[pos]])
        cases.append(("mutate", f"{pos}:{base[pos]:#04x}->{val:#04x}",
                      base[:pos] + bytes([val]) + base[pos + 1:]))
    allowed = (pyloader.FormatError, OSError)
    opened = rejected = loaded = 0
    bad = []
    for i, (kind, what, data) in enumerate(cases):
        print("CASE", kind, what, flush=True)
        p = os.path.join(work, f"case{i}.safetensors")
        with open(p, "wb") as f:
            f.write(data)
        try:
            try:
                ckpt = pyloader.open(p)
            except allowed:
                rejected += 1
                continue
            opened += 1
            try:
                a = pyloader.load(p, "mmap")
                b = pyloader.load(p, "pread")
            except allowed:
                continue
            if sorted(a) != sorted(b) or sorted(a) != sorted(ckpt.keys()):
                bad.append(f"{kind} {what}: key sets differ")
                continue
            for n in a:
                if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or \
                        not mx.array_equal(a[n], b[n], equal_nan=True).item():
                    bad.append(f"{kind} {what}: mmap and pread differ on {n!r}")
            loaded += 1
            del a, b
        except Exception as e:  # anything else is a bug
            bad.append(f"{kind} {what}: {type(e).__name__}: {e}")
        finally:
            os.unlink(p)
    for line in bad:
        print("UNEXPECTED", line)
    print(f"SUMMARY cases={len(cases)} opened={opened} loaded={loaded} rejected={rejected} "
          f"bad={len(bad)}", flush=True)
    sys.exit(1 if bad else 0)
''')


def robustness_base() -> bytes:
    rng = np.random.default_rng(3)
    return build([
        ("emb", "F32", [2, 3], rng.standard_normal(6).astype(np.float32).tobytes()),
        ("ids", "I64", [2], np.array([7, -9], np.int64).tobytes()),
        ("odd", "U8", [3], b"\x01\x02\x03"),
        ("h", "BF16", [2], np.array([0x3FC0, 0xBF80], np.uint16).tobytes()),
        ("s", "F16", [], np.float16(0.5).tobytes()),
        ("e", "I32", [0, 2], b""),
        ("m", "BOOL", [3], b"\x01\x00\x01"),
    ], {"format": "pt"})


def test_truncations_and_mutations_never_crash(tmp_path: Path):
    base = robustness_base()
    (tmp_path / "base.safetensors").write_bytes(base)
    ckpt = pyloader.open(tmp_path / "base.safetensors")  # the base itself is valid
    assert len(ckpt) == 7
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", ROBUSTNESS_SCRIPT, str(tmp_path / "base.safetensors"), str(work),
         "500", "1234"],
        capture_output=True, text=True, timeout=120,
        cwd=tmp_path,  # not the repo root: its pyloader/ source tree would shadow the install
    )
    lines = proc.stdout.splitlines()
    cases = [line for line in lines if line.startswith("CASE ")]
    report = "\n".join([line for line in lines if not line.startswith("CASE ")]
                       + (["last case started: " + cases[-1]] if cases else [])
                       + ["stderr: " + proc.stderr[-3000:]])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{report}"
    summary = [line for line in lines if line.startswith("SUMMARY")]
    assert summary, report
    stats = dict(kv.split("=") for kv in summary[0].split()[1:])
    assert int(stats["cases"]) == len(base) + 500
    # Both sides of the validator are exercised, not just one.
    assert int(stats["rejected"]) > len(base), report
    assert int(stats["loaded"]) > 20, report
