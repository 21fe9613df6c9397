"""Every GGUF header rule (docs/format-rules.md, "GGUF"), one hand-written file each.

Each file goes through ``read_gguf`` (the header checks, then ``mx.load``) in a child
process: before these rules, several of them killed the process on a signal (alignment 0:
SIGFPE, 9 dimensions: SIGABRT, a float64 value: SIGSEGV), which must fail one test, not
the whole run.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest

from fuzz_gguf import (
    ARRAY, BOOL, F32, F64, I32, STRING, U8, U32, U64, Raw, gguf_bytes, nested_array,
)

W = ("w.weight", [4], 0, bytes(16))  # one F32 tensor of 4 elements


_CHILD = textwrap.dedent("""
    import json, sys
    from pyloader.gguf import read_gguf
    for line in sys.stdin:
        try:
            read_gguf(line.rstrip("\\n"))
            out = ["ok", ""]
        except Exception as e:
            out = [type(e).__name__, str(e)]
        print(json.dumps(out), flush=True)
""")


class _Reader:
    """One child process reading files one by one: a signal kills the child (and fails
    that test), not pytest; the next test starts a new child."""

    def __init__(self):
        self.proc = None

    def read(self, path) -> tuple[str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise AssertionError(f"the reader died on {path} (exit {rc}; a negative code is "
                                 "a signal)")
        kind, message = json.loads(line)
        return kind, message

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc.stdout.close()


_reader = _Reader()


@pytest.fixture(scope="module", autouse=True)
def _close_reader():
    yield
    _reader.close()


def _read(path) -> tuple[str, str]:
    """(exception type name or "ok", message) of read_gguf(path), in the child."""
    return _reader.read(path)


def _refused(tmp_path, data: bytes, kind: str, *fragments: str) -> str:
    p = tmp_path / "t.gguf"
    p.write_bytes(data)
    got, message = _read(p)
    assert got == kind, (got, message)
    assert message.startswith(f"{p}: "), message
    for f in fragments:
        assert f in message, message
    return message


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


# --- the file --------------------------------------------------------------------


def test_empty_file(tmp_path):
    _refused(tmp_path, b"", "FormatError", "not a GGUF file (empty)")


def test_wrong_magic(tmp_path):
    _refused(tmp_path, b"GGML" + bytes(60), "FormatError", "not a GGUF file (magic b'GGML')")


def test_shorter_than_the_fixed_header(tmp_path):
    _refused(tmp_path, b"GGUF\x03\0\0\0", "FormatError", "8 bytes; the fixed header takes 24")


def test_unknown_version(tmp_path):
    _refused(tmp_path, _header(0, 0, version=1), "UnsupportedError", "GGUF version 1")


def test_counts_the_file_cannot_hold(tmp_path):
    _refused(tmp_path, _header(2**60, 2**60) + bytes(100), "FormatError",
             f"header declares {2**60} tensors and {2**60} metadata keys, more than the "
             "100 bytes")


# --- metadata --------------------------------------------------------------------


def test_key_past_the_end(tmp_path):
    _refused(tmp_path, _header(0, 1) + struct.pack("<Q", 2**40) + bytes(40), "FormatError",
             "metadata key #0: header ends early")


def test_key_not_utf8(tmp_path):
    _refused(tmp_path, _header(0, 1) + _s(b"\xff\xfe") + struct.pack("<IB", U8, 1),
             "FormatError", "metadata key #0: key name is not valid UTF-8")


def test_duplicate_key(tmp_path):
    _refused(tmp_path, gguf_bytes([("a", U32, 1), ("b", U8, 2), ("a", U32, 3)], [W]),
             "FormatError", "metadata key 'a': duplicate key")


def test_unknown_value_type(tmp_path):
    _refused(tmp_path, gguf_bytes([("a", 13, Raw(bytes(8)))], [W]), "FormatError",
             "metadata key 'a': unknown value type 13")


def test_string_value_not_utf8(tmp_path):
    _refused(tmp_path, gguf_bytes([("a", STRING, b"ok\xc0\xaf")], [W]), "FormatError",
             "metadata key 'a': string value is not valid UTF-8")


def test_unknown_array_element_type(tmp_path):
    _refused(tmp_path, gguf_bytes([("a", ARRAY, Raw(struct.pack("<IQ", 99, 1)))], [W]),
             "FormatError", "metadata key 'a': unknown array element type 99")


def test_array_longer_than_mlx_can_hold(tmp_path):
    _refused(tmp_path, gguf_bytes([("a", ARRAY, Raw(struct.pack("<IQ", U8, 2**31)))], [W]),
             "FormatError", f"metadata key 'a': array of {2**31} elements (at most "
             f"{2**31 - 1})")


def test_array_past_the_end(tmp_path):
    _refused(tmp_path, gguf_bytes([("a", ARRAY, Raw(struct.pack("<IQ", U32, 2**30)))], []),
             "FormatError", "metadata key 'a': header ends early")
    _refused(tmp_path, gguf_bytes([("a", ARRAY, Raw(struct.pack("<IQ", STRING, 2**30)))], []),
             "FormatError", f"metadata key 'a': array of {2**30} strings cannot fit")


def test_nesting_5000_deep_is_refused_without_recursion(tmp_path):
    """5,000 levels gave a RecursionError traceback; the walk is iterative and stops at 64."""
    _refused(tmp_path, gguf_bytes([("deep", ARRAY, nested_array(5000))], [W]), "FormatError",
             "metadata key 'deep': arrays nested deeper than 64")


def test_arrays_of_arrays_mlx_cannot_read(tmp_path):
    _refused(tmp_path, gguf_bytes([("n", ARRAY, nested_array(64))], [W]), "UnsupportedError",
             "metadata key 'n': array[array[", "arrays of arrays")


@pytest.mark.parametrize("value", [1.0, (F64, [1.0, 2.0])], ids=["scalar", "array"])
def test_float64_values_mlx_misreads(tmp_path, value):
    """MLX advanced 4 bytes past a float64 instead of 8 and read the rest of the header
    from the wrong place: SIGSEGV."""
    vtype = ARRAY if isinstance(value, tuple) else F64
    _refused(tmp_path, gguf_bytes([("x", vtype, value), ("y", U32, 1)], [W]),
             "UnsupportedError", "metadata key 'x'", "float64", "misreads")


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_a_positive_power_of_two(tmp_path, alignment):
    """Alignment 0 was a SIGFPE in MLX's reader."""
    _refused(tmp_path, gguf_bytes([("general.alignment", U32, alignment)], [W], alignment=1),
             "FormatError", f"metadata key 'general.alignment': {alignment} is not a power "
             "of two")


@pytest.mark.parametrize("vtype,value", [(U64, 32), (I32, 32), (STRING, "32"), (BOOL, 1)])
def test_alignment_a_uint32(tmp_path, vtype, value):
    """MLX's reader ignores an alignment of another type (and uses 32): refused, as
    llama.cpp refuses it."""
    _refused(tmp_path, gguf_bytes([("general.alignment", vtype, value)], [W]), "FormatError",
             "metadata key 'general.alignment': must be a uint32")


# --- tensors ---------------------------------------------------------------------


def test_tensor_info_past_the_end(tmp_path):
    _refused(tmp_path, _header(1, 0) + _s(b"w") + struct.pack("<I", 2) + bytes(12),
             "FormatError", "tensor 'w': header ends early")


def test_tensor_name_not_utf8(tmp_path):
    _refused(tmp_path, gguf_bytes([], [(b"w\xff", [4], 0, bytes(16))]), "FormatError",
             "tensor #0: tensor name is not valid UTF-8")


def test_duplicate_tensor_name(tmp_path):
    _refused(tmp_path, gguf_bytes([], [W, ("x", [1], 0, bytes(4)), W]), "FormatError",
             "tensor 'w.weight': duplicate tensor name")


@pytest.mark.parametrize("n_dims", [5, 9])
def test_more_than_four_dimensions(tmp_path, n_dims):
    """9 dimensions was a SIGABRT (gguflib's assertion); 5 are not GGUF (GGML_MAX_DIMS)."""
    _refused(tmp_path, gguf_bytes([], [("w", [1] * (n_dims - 1) + [4], 0, bytes(16))]),
             "FormatError", f"tensor 'w': {n_dims} dimensions (GGUF allows at most 4)")


@pytest.mark.parametrize("ggml_type", [4, 5, 31, 42, 2**32 - 1])
def test_unknown_tensor_type(tmp_path, ggml_type):
    """Types 4 and 5 (removed) were a SIGFPE in MLX's reader (a block of 0 elements)."""
    _refused(tmp_path, gguf_bytes([], [("w", [32], ggml_type, bytes(32))]), "FormatError",
             f"tensor 'w': unknown ggml type {ggml_type}")


def test_dimension_above_int64(tmp_path):
    _refused(tmp_path, gguf_bytes([], [("w", [0, 2**63], 0, b"")]), "FormatError",
             f"tensor 'w': dimension {2**63} is above 2**63-1")


def test_element_count_above_int64(tmp_path):
    """The product wrapped to a small number in MLX's 64-bit arithmetic."""
    _refused(tmp_path, gguf_bytes([], [("w", [2**32, 2**32], 0, b"")]), "FormatError",
             f"tensor 'w': shape ({2**32}, {2**32}) has {2**64} elements, above 2**63-1")


@pytest.mark.parametrize("dims,ggml_type,name", [([16], 2, "Q4_0"), ([], 8, "Q8_0"),
                                                 ([255, 1], 14, "Q6_K")])
def test_rows_of_whole_blocks(tmp_path, dims, ggml_type, name):
    row = dims[0] if dims else 1
    _refused(tmp_path, gguf_bytes([], [("w.weight", dims, ggml_type, bytes(300))]),
             "FormatError", f"tensor 'w.weight': {name} stores blocks", f"has {row}")


def test_offset_not_aligned(tmp_path):
    _refused(tmp_path, gguf_bytes([], [("w", [4], 0, bytes(16), 8)]), "FormatError",
             "tensor 'w': data offset 8 is not a multiple of the alignment 32")


def test_data_past_the_end_of_the_file(tmp_path):
    data = gguf_bytes([], [("w", [4], 0, bytes(16))])
    _refused(tmp_path, data[:-1], "FormatError", "tensor 'w': data [", "ends past the end of "
             f"the file ({len(data) - 1} bytes)")


def test_q2_k_needs_84_bytes_a_block(tmp_path):
    """gguflib sizes a Q2_K block at 82 bytes but decodes 84: a last tensor sized at 82
    per block passed MLX's bound and was decoded past the end of the file."""
    data = gguf_bytes([], [("w", [256], 10, bytes(84))])
    _refused(tmp_path, data[:-2], "FormatError", "tensor 'w': data [", "ends past the end")


def test_offset_that_wraps(tmp_path):
    _refused(tmp_path, gguf_bytes([], [("w", [4], 0, b"", 2**64 - 32)]), "FormatError",
             "tensor 'w': data [", "ends past the end")


def test_overlapping_tensors(tmp_path):
    _refused(tmp_path, gguf_bytes([], [("a", [8], 0, bytes(32)), ("b", [4], 0, bytes(16), 0)]),
             "FormatError", "tensor 'b': data overlaps tensor 'a'")


def test_dimension_above_mlx_int32(tmp_path):
    _refused(tmp_path, gguf_bytes([], [("w", [0, 2**31], 0, b"")]), "UnsupportedError",
             f"tensor 'w': shape ({2**31}, 0) has a dimension above {2**31 - 1}")


@pytest.mark.parametrize("tensors,fragment", [
    ([("blk.0.attn_q", [32], 2, bytes(18))], "tensor 'blk.0.attn_q': a Q4_0 tensor's name "
                                             "must end in '.weight'"),
    ([("a.weight", [32], 8, bytes(34)), ("a.scales", [1], 0, bytes(4))],
     "tensor 'a.scales': the name MLX gives the scales of Q8_0 tensor 'a.weight' is taken"),
])
def test_quantized_names_mlx_splits(tmp_path, tensors, fragment):
    _refused(tmp_path, gguf_bytes([], tensors), "UnsupportedError", fragment)


def test_a_valid_file_reads(tmp_path):
    """The rules leave a file that keeps them alone: every type MLX reads, an alignment,
    metadata of every other value type."""
    md = [("general.alignment", U32, 64), ("s", STRING, "é"), ("b", BOOL, 1),
          ("f", F32, 0.5), ("a", ARRAY, (STRING, ["x", ""])), ("e", ARRAY, (I32, []))]
    tensors = [("f32", [4], 0, bytes(16)), ("f16", [2, 3], 1, bytes(12)),
               ("q.weight", [64, 2], 2, bytes(72)), ("r.weight", [32], 3, bytes(20)),
               ("s.weight", [32], 8, bytes(34)), ("bf16", [2], 30, bytes(4)),
               ("k2", [256], 10, bytes(84)), ("k6", [256], 14, bytes(210)),
               ("empty", [0], 0, b""), ("scalar", [], 0, bytes(4))]
    p = tmp_path / "ok.gguf"
    p.write_bytes(gguf_bytes(md, tensors, alignment=64))
    assert _read(p) == ("ok", "")
    from pyloader.io.gguf_header import read_header

    h = read_header(p)
    assert h.alignment == 64 and h.data_offset % 64 == 0
    assert h.tensors["q.weight"].shape == (2, 64) and h.tensors["q.weight"].nbytes == 72
    assert h.tensors["scalar"].shape == () and h.value_types["a"] == "array[string]"
