"""Differential fuzzing of pyloader's safetensors parser against the
``safetensors`` package (the reference).

Each case is a valid file (written by the reference's own ``serialize`` or
byte by byte, in a random tensor order and padding) that is then mutated:
bit flips, byte writes, truncation, extension, a rewritten header length, or
edits of the header's JSON (offsets, shapes, dtypes, duplicate keys, unknown
fields, huge and non-integer numbers, deep nesting, non-UTF-8 and escaped
names, metadata). The verdicts must agree:

* reference accepts -> pyloader opens the file, with the same names, dtypes,
  shapes and metadata, and the ``mmap`` and ``pread`` strategies return the
  reference's bytes (or raise ``TypeError`` for a dtype or shape MLX cannot
  represent);
* reference rejects -> pyloader raises ``FormatError``;
* reference accepts but pyloader rejects -> allowed only for the documented
  stricter rules (``STRICTER``, docs/format-rules.md), and only when the
  header really breaks that rule (checked independently here).

Run as a script (``python tests/fuzz_safetensors.py --cases N --seed S``) so
that a crash in the extension is a failed run, not a dead test process; it
prints one JSON summary line. ``--seconds`` with ``--hypothesis`` drives the
same generator from hypothesis for a time-boxed run instead.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

MAX_HEADER = 100_000_000
U64_MAX = (1 << 64) - 1

# Dtypes the reference knows, with bits per element.
DTYPES = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
# Names the reference's serialize() takes for each dtype (it spells them the
# torch way); sub-byte types are written byte by byte instead.
SERIALIZE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
    "F32": "float32", "F64": "float64", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
}
BAD_DTYPES = ["f32", "FP32", "float32", "U4", "I4", "F8", "", "BF16 ", "Q4_0", "E8M0"]
NAMES = ["w", "model.layers.0.self_attn.q_proj.weight", "", "é", "名前", "a\u0000b",
         "tab\there", "quote\"d", "back\\slash", "emoji😀", "__metadata_", "x" * 40]

# pyloader's rules that are stricter than the reference's, each with the
# message fragment it raises and a check that the header really breaks it.
STRICTER = ("duplicate key", "unexpected field", "nesting deeper than 64",
            # serde also reads a struct from an array of its fields in order
            # (["F32", [2], [0, 8]]); the format is objects only.
            "tensor entry must be a JSON object, got an array")


# ----------------------------------------------------------------------------
# Random sources: one interface, driven by random.Random or by hypothesis.


class RandomDraw:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)


class HypothesisDraw:
    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def choice(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def bytes(self, n: int) -> bytes:
        return self.data.draw(self.st.binary(min_size=n, max_size=n))


# ----------------------------------------------------------------------------
# Valid files


def _header_len(data: bytes) -> int:
    return struct.unpack_from("<Q", data)[0]


def random_tensors(d) -> tuple[list[tuple[str, str, list[int], bytes]], dict | None]:
    n = d.int(0, 5)
    names = set()
    tensors = []
    for _ in range(n):
        name = d.choice(NAMES) + (str(d.int(0, 99)) if d.int(0, 2) else "")
        if name in names or name == "__metadata__":
            continue
        names.add(name)
        dtype = d.choice(list(DTYPES))
        shape = [d.int(0, 4) if d.int(0, 5) else d.int(0, 70) for _ in range(d.int(0, 3))]
        elems = 1
        for x in shape:
            elems *= x
        bits = elems * DTYPES[dtype]
        if bits % 8:  # sub-byte types need whole bytes
            shape, bits = [2], 2 * DTYPES[dtype]
            if bits % 8:
                shape, bits = [4], 4 * DTYPES[dtype]
        tensors.append((name, dtype, shape, d.bytes(bits // 8)))
    metadata = None
    if d.int(0, 2) == 0:
        metadata = {d.choice(NAMES) + str(i): d.choice(NAMES) for i in range(d.int(0, 3))}
    return tensors, metadata


def write_reference(tensors, metadata) -> bytes:
    """The reference writer (8-byte padded header, tensors in its own order)."""
    from safetensors import TensorSpec, serialize

    keep = []
    specs = {}
    for name, dtype, shape, raw in tensors:
        buf = ctypes.create_string_buffer(raw, max(len(raw), 1))
        keep.append(buf)
        specs[name] = TensorSpec(dtype=SERIALIZE_NAMES[dtype], shape=shape,
                                 data_ptr=ctypes.addressof(buf), data_len=len(raw))
    return serialize(specs, metadata)


def write_raw(d, tensors, metadata) -> bytes:
    """Byte by byte: tensors in the given order, unpadded or padded with
    JSON whitespace, metadata first, last or absent (``null`` sometimes)."""
    parts = []
    data = b""
    for name, dtype, shape, raw in tensors:
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        items = list(entry.items())
        if d.int(0, 3) == 0:
            d_rng_shuffle(d, items)
        parts.append(json.dumps(name, ensure_ascii=bool(d.int(0, 1))) + ":" +
                     json.dumps(dict(items), separators=(",", ":")))
        data += raw
    if metadata is not None or d.int(0, 5) == 0:
        meta = "null" if metadata is None else json.dumps(metadata, ensure_ascii=bool(d.int(0, 1)))
        block = '"__metadata__":' + meta
        parts.insert(d.int(0, len(parts)), block)
    header = ("{" + ",".join(parts) + "}").encode()
    ws = [b"", b" ", b"\n", b"\t", b"\r\n", b"    "]
    header = d.choice(ws) + header + d.choice(ws) * d.int(0, 3)
    return struct.pack("<Q", len(header)) + header + data


def d_rng_shuffle(d, items: list) -> None:
    for i in range(len(items) - 1, 0, -1):
        j = d.int(0, i)
        items[i], items[j] = items[j], items[i]


def valid_file(d) -> bytes:
    tensors, metadata = random_tensors(d)
    if d.int(0, 1) and all(t[1] in SERIALIZE_NAMES for t in tensors):
        return write_reference(tensors, metadata)
    d_rng_shuffle(d, tensors)
    return write_raw(d, tensors, metadata)


# ----------------------------------------------------------------------------
# Mutations


class Raw(str):
    """A JSON token written verbatim."""


def dump(v, ascii: bool = False) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, Obj):
        return "{" + ",".join(dump(k, ascii) + ":" + dump(x, ascii) for k, x in v) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dump(x, ascii) for x in v) + "]"
    return json.dumps(v, ensure_ascii=ascii)


class Obj(list):
    """A JSON object as an ordered list of pairs (duplicates allowed)."""


def parse_pairs(text: str):
    return json.loads(text, object_pairs_hook=Obj)


HUGE = ["18446744073709551615", "18446744073709551616", "9223372036854775807",
        "9223372036854775808", "4294967296", "2147483648", "1" + "0" * 30, "1e400",
        "-1", "-0", "0.0", "2.0", "1e3", "1E1", "00", "0x10", "true", "null", '"8"',
        "[]", "{}", "-9223372036854775808"]


def num_token(d, value) -> Raw:
    if not isinstance(value, int) or isinstance(value, bool):
        value = 0  # an earlier mutation left a non-number here
    k = d.int(0, 9)
    if k < 4:
        return Raw(str(max(0, value + d.int(-3, 3))))
    if k < 6:
        return Raw(d.choice(HUGE))
    if k < 8:
        return Raw(str(d.int(0, 1 << d.int(1, 64))))
    return Raw(str(value))


def json_edit(d, data: bytes) -> bytes | None:
    n = _header_len(data)
    if n > len(data) - 8:
        return None
    try:
        head = parse_pairs(data[8:8 + n].decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if _depth(head) > 200:  # stacked nesting mutations: nothing more to learn
        return None
    if not isinstance(head, Obj):
        return None
    body = data[8 + n:]
    entries = [(i, k, v) for i, (k, v) in enumerate(head) if isinstance(v, Obj)
               and k != "__metadata__"]
    kind = d.int(0, 13)
    if entries and kind <= 6:
        i, name, e = d.choice(entries)
        fields = {k: j for j, (k, _) in enumerate(e)}
        if kind == 0 and "data_offsets" in fields:       # offsets
            j = fields["data_offsets"]
            b, end = e[j][1] if len(e[j][1]) == 2 else (0, 0)
            which = d.int(0, 4)
            if which == 0:
                e[j] = ("data_offsets", [num_token(d, b), Raw(str(end))])
            elif which == 1:
                e[j] = ("data_offsets", [Raw(str(b)), num_token(d, end)])
            elif which == 2:
                e[j] = ("data_offsets", [Raw(str(end)), Raw(str(b))])
            elif which == 3:
                e[j] = ("data_offsets", [Raw(str(b))] * d.int(0, 3))
            else:
                e[j] = ("data_offsets", [num_token(d, b), num_token(d, end)])
        elif kind == 1 and "shape" in fields:            # shapes
            j = fields["shape"]
            shape = list(e[j][1]) if isinstance(e[j][1], list) else []
            which = d.int(0, 3)
            if which == 0 and shape:
                k = d.int(0, len(shape) - 1)
                shape[k] = num_token(d, shape[k])
            elif which == 1:
                shape.insert(d.int(0, len(shape)), Raw(d.choice(["1", "0", "2"]) if d.int(0, 1)
                                                       else d.choice(HUGE)))
            elif which == 2 and shape:
                shape.pop(d.int(0, len(shape) - 1))
            else:
                shape = [Raw(d.choice(HUGE))]
            e[j] = ("shape", shape)
        elif kind == 2 and "dtype" in fields:            # dtypes
            j = fields["dtype"]
            e[j] = ("dtype", d.choice(list(DTYPES)) if d.int(0, 2) else d.choice(BAD_DTYPES))
        elif kind == 3:                                  # duplicate a field
            k, v = d.choice(list(e)) if e else ("dtype", "U8")
            e.insert(d.int(0, len(e)), (k, v))
        elif kind == 4:                                  # unknown field, maybe nested
            depth = d.choice([0, 1, 10, 62, 63, 64, 65, 127, 128, 129, 500])
            e.insert(d.int(0, len(e)), (d.choice(["x", "offset", "dtype ", "Shape"]),
                                        Raw("[" * depth + "1" + "]" * depth)))
        elif kind == 5 and e:                            # drop a field
            e.pop(d.int(0, len(e) - 1))
        else:                                            # the entry is not an object
            head[i] = (name, Raw(d.choice(['"F32"', "[]", "null", "1", '["F32",[1],[0,4]]'])))
    elif kind == 7 and head:                             # duplicate a tensor
        k, v = d.choice(list(head))
        head.insert(d.int(0, len(head)), (k if d.int(0, 3) else k + "x", v))
    elif kind == 8:                                      # metadata edits
        value = d.choice([Raw("null"), Raw("{}"), Raw('{"a":"b","a":"c"}'), Raw('{"a":1}'),
                          Raw('"x"'), Raw("[]"), Raw('{"a":{"b":"c"}}'), Raw('{"\\ud800":"x"}'),
                          Raw('{"a":"\\u00e9\\ud83d\\ude00"}'), Raw('{"a":"b"}')])
        head.insert(d.int(0, len(head)), ("__metadata__", value))
    elif kind == 9 and head:                             # rename (escapes, duplicates)
        j = d.int(0, len(head) - 1)
        head[j] = (d.choice(NAMES + [head[0][0], "__metadata__"]), head[j][1])
    elif kind == 10:                                     # nesting at the top level
        depth = d.choice([1, 63, 64, 65, 128, 129, 1000])
        head.insert(d.int(0, len(head)), ("n", Raw("[" * depth + "]" * depth)))
    elif kind == 11:                                     # top level not an object
        head = Raw(d.choice(["[]", "null", "1", '"x"', "[" + dump(head) + "]"]))
    elif kind == 12 and entries:                         # shuffle entries
        d_rng_shuffle(d, head)
    else:                                                # reorder an entry's fields
        if entries:
            d_rng_shuffle(d, d.choice(entries)[2])
    try:
        text = dump(head).encode()
    except UnicodeEncodeError:  # an escaped lone surrogate: keep it escaped
        text = dump(head, ascii=True).encode("utf-8", "surrogatepass")
    if d.int(0, 5) == 0:                                 # non-UTF-8 / odd bytes in a string
        quotes = [i for i, c in enumerate(text) if c == 0x22]
        if quotes:
            at = d.choice(quotes) + 1
            text = text[:at] + d.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82",
                                         b"\x80", b"\x00", b"\n", b"\\u0000", b"\\x"]) + text[at:]
    # Keep the data section consistent with the new offsets sometimes, so
    # that edits reach the deeper rules (and some mutants are valid).
    if d.int(0, 1):
        try:
            ends = [int(v[j][1][1]) for _, v in (head if isinstance(head, Obj) else [])
                    if isinstance(v, Obj) for j in range(len(v)) if v[j][0] == "data_offsets"
                    and isinstance(v[j][1], list) and len(v[j][1]) == 2]
            end = max(ends, default=0)
            if 0 <= end <= 1 << 16:
                body = (body + bytes(max(0, end - len(body))))[:end]
        except (TypeError, ValueError, OverflowError):
            pass
    length = len(text) if d.int(0, 7) else len(text) + d.int(-2, 2)
    return struct.pack("<Q", max(0, length) & U64_MAX) + text + body


def mutate(d, data: bytes) -> tuple[bytes, str]:
    kind = d.choice(["bitflip", "byte", "truncate", "extend", "length", "json", "json",
                     "json", "json", "splice"])
    if kind == "bitflip":
        buf = bytearray(data)
        # Mostly in the length field and header, where the rules are.
        n = min(len(buf), 8 + _header_len(data) if len(buf) >= 8 else len(buf))
        for _ in range(d.int(1, 3)):
            at = d.int(0, max(0, (n if d.int(0, 3) else len(buf)) - 1))
            if at < len(buf):
                buf[at] ^= 1 << d.int(0, 7)
        return bytes(buf), kind
    if kind == "byte" and data:
        buf = bytearray(data)
        at = d.int(0, len(buf) - 1)
        buf[at] = d.choice([0, 0x22, 0x2C, 0x5B, 0x5D, 0x7B, 0x7D, 0x30, 0x39, 0x2D, 0x20,
                            0x0C, 0x80, 0xFF, d.int(0, 255)])
        return bytes(buf), kind
    if kind == "truncate":
        return data[:d.int(0, max(0, len(data) - 1))], kind
    if kind == "extend":
        return data + d.choice([b"\x00", b" ", d.bytes(d.int(1, 16))]), kind
    if kind == "length" and len(data) >= 8:
        n = _header_len(data)
        new = d.choice([0, 1, 2, 7, 8, n - 1, n + 1, n + 8, len(data) - 8, len(data) - 7,
                        MAX_HEADER, MAX_HEADER + 1, 1 << 32, 1 << 63, U64_MAX, U64_MAX - 7,
                        d.int(0, U64_MAX)])
        return struct.pack("<Q", new & U64_MAX) + data[8:], kind
    if kind == "splice" and len(data) > 8:
        a, b = sorted((d.int(8, len(data)), d.int(8, len(data))))
        return data[:a] + data[b:], kind
    if len(data) >= 8:
        edited = json_edit(d, data)
        if edited is not None:
            return edited, "json"
    return data + b" ", "extend"


def make_case(d) -> tuple[bytes, str]:
    data = valid_file(d)
    if d.int(0, 9) == 0:
        return data, "valid"
    kinds = []
    for _ in range(d.choice([1, 1, 1, 2, 3])):
        data, kind = mutate(d, data)
        kinds.append(kind)
    return data, "+".join(kinds)


# ----------------------------------------------------------------------------
# The oracle


def reference(data: bytes):
    """(names -> (dtype, shape, bytes), metadata) or None when the reference rejects."""
    from safetensors import SafetensorError, deserialize

    try:
        tensors = deserialize(data)
    except SafetensorError:
        return None
    out = {name: (t["dtype"], list(t["shape"]), bytes(t["data"])) for name, t in tensors}
    # deserialize() drops the metadata: the header is valid JSON here.
    head = json.loads(data[8:8 + _header_len(data)])
    return out, head.get("__metadata__") or {}


def _depth(v) -> int:
    """Nesting depth of containers (the top-level object is 1); iterative,
    so 1000-deep headers need no recursion."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, Obj):
            deepest = max(deepest, d)
            stack.extend((y, d + 1) for _, y in x)
        elif isinstance(x, list):
            deepest = max(deepest, d)
            stack.extend((y, d + 1) for y in x)
    return deepest


def breaks_stricter_rule(data: bytes, message: str) -> bool:
    """True when the message is a documented stricter rule and the header
    really breaks it (checked with Python's json, not with pyloader)."""
    head = parse_pairs(data[8:8 + _header_len(data)].decode())

    def objects(v):
        if isinstance(v, Obj):
            yield v
            for _, x in v:
                yield from objects(x)
        elif isinstance(v, list):
            for x in v:
                yield from objects(x)

    if "duplicate key" in message:
        return any(len({k for k, _ in o}) < len(o) for o in objects(head))
    if "unexpected field" in message:
        return any(isinstance(v, Obj) and {k for k, _ in v} - {"dtype", "shape", "data_offsets"}
                   for k, v in head if k != "__metadata__")
    if "tensor entry must be a JSON object, got an array" in message:
        return any(isinstance(v, list) and not isinstance(v, Obj)
                   for k, v in head if k != "__metadata__")
    if "nesting deeper than 64" in message:
        return _depth(head) > 64
    return False


class Mismatch(AssertionError):
    pass


def check(data: bytes, path: Path, counts: Counter) -> str:
    """Runs one case; returns its outcome, raises Mismatch on disagreement."""
    import mlx.core as mx

    import pyloader

    if path.exists():
        path.unlink()  # a new inode: mappings of earlier cases stay valid
    path.write_bytes(data)
    ref = reference(data)
    try:
        ckpt = pyloader.open(path)
    except pyloader.FormatError as e:
        msg = str(e)
        if not msg.startswith(str(path)):
            raise Mismatch(f"FormatError does not name the file: {msg!r}")
        if ref is None:
            return "both-reject"
        rule = next((r for r in STRICTER if r in msg), None)
        if rule and breaks_stricter_rule(data, msg):
            counts[f"stricter:{rule}"] += 1
            return "stricter"
        raise Mismatch(f"reference accepts, pyloader rejects: {msg}")
    except Exception as e:  # noqa: BLE001 - any other type is the bug under test
        raise Mismatch(f"pyloader raised {type(e).__name__} (not FormatError): {e}") from e
    if ref is None:
        raise Mismatch("pyloader accepts a file the reference rejects")
    tensors, metadata = ref
    if sorted(ckpt.keys()) != sorted(tensors):
        raise Mismatch(f"names differ: {sorted(ckpt.keys())} vs {sorted(tensors)}")
    if ckpt.metadata() != metadata:
        raise Mismatch(f"metadata differs: {ckpt.metadata()} vs {metadata}")
    loadable = []
    for name, (dtype, shape, raw) in tensors.items():
        m = ckpt[name]
        if (m.dtype, list(m.shape), m.nbytes) != (dtype, shape, len(raw)):
            raise Mismatch(f"{name!r}: {m.dtype} {m.shape} {m.nbytes} vs {dtype} {shape}")
        if data[m.offset:m.offset + m.nbytes] != raw:
            raise Mismatch(f"{name!r}: offset {m.offset} does not hold the reference's bytes")
        if dtype not in ("F4", "F6_E2M3", "F6_E3M2") and max(shape, default=0) < 2**31:
            loadable.append(name)
    for strategy in ("mmap", "pread"):
        got = pyloader.load(path, strategy=strategy, names=loadable)
        for name in loadable:
            a = got[name]
            b = bytes(memoryview(a.reshape(-1).view(mx.uint8))) if a.size else b""
            if b != tensors[name][2] or list(a.shape) != tensors[name][1]:
                raise Mismatch(f"{strategy}: {name!r} bytes or shape differ")
        del got
        for name in set(tensors) - set(loadable):
            try:
                pyloader.load(path, strategy=strategy, names=[name])
            except TypeError:
                continue
            raise Mismatch(f"{strategy}: {name!r} ({tensors[name][0]}) loaded without an error")
    counts["loaded_tensors"] += len(loadable)
    return "both-accept"


def run_case(d, path: Path, counts: Counter) -> None:
    data, kind = make_case(d)
    try:
        outcome = check(data, path, counts)
    except Mismatch as e:
        raise Mismatch(f"{e}\n  mutation: {kind}\n  file: {data[:600]!r}") from None
    counts[outcome] += 1
    counts["cases"] += 1
    counts[f"kind:{kind.split('+')[0]}"] += 1


# ----------------------------------------------------------------------------
# Entry points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None, help="time box instead of a count")
    ap.add_argument("--hypothesis", action="store_true", help="drive the generator by hypothesis")
    args = ap.parse_args(argv)
    sys.setrecursionlimit(20_000)  # _depth/dump of 1000-deep headers
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    print(f"fuzz seed {seed}", file=sys.stderr, flush=True)
    counts: Counter = Counter()
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="pyloader-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                           else None)
    path = Path(tmp) / "m.safetensors"
    try:
        if args.hypothesis:
            run_hypothesis(path, counts, args.seconds or 600.0, seed)
        else:
            rng = random.Random(seed)
            while True:
                if args.seconds is not None:
                    if time.perf_counter() - t0 >= args.seconds:
                        break
                elif counts["cases"] >= args.cases:
                    break
                run_case(RandomDraw(rng), path, counts)
    except Mismatch as e:
        print(f"MISMATCH (seed {seed}, case {counts['cases']}): {e}", file=sys.stderr)
        return 1
    finally:
        if path.exists():
            path.unlink()
        os.rmdir(tmp)
    summary = {"seed": seed, "seconds": round(time.perf_counter() - t0, 1), **counts}
    print(json.dumps(summary, sort_keys=True))
    return 0


def run_hypothesis(path: Path, counts: Counter, seconds: float, seed: int) -> None:
    from hypothesis import HealthCheck, given, seed as hseed, settings
    from hypothesis import strategies as st

    t_end = time.perf_counter() + seconds
    # hypothesis stops at max_examples or at the first failure (which it
    # shrinks and re-raises): run rounds of fresh seeds until the time box ends.
    round_ = 0
    while time.perf_counter() < t_end:
        # The time box is checked between rounds only: an example that drew
        # nothing because time ran out would make hypothesis's replays flaky.
        @hseed(seed + round_)
        @settings(max_examples=500, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), print_blob=True)
        @given(st.data())
        def one(data):
            run_case(HypothesisDraw(data), path, counts)

        one()
        round_ += 1
        counts["hypothesis_rounds"] = round_


if __name__ == "__main__":
    sys.exit(main())
