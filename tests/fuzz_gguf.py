"""Mutational fuzzing of pyloader's GGUF reading (``read_gguf``: the header checks, then
``mx.load``, whose GGUF reader dies on a signal when a header lies to it).

Each case is a valid GGUF file (random metadata of every value type, an alignment, tensors
of the types MLX reads and some it does not, random shapes in whole blocks) that is then
mutated: bit flips, byte writes, truncation, extension, splices, and rewrites of one header
field (a count, a string length, a value type, an array length, a dimension count, a
dimension, a tensor type, a data offset, the alignment) with a boundary value, or
structural edits (a duplicated key or tensor, arrays nested thousands deep). The verdict of
every case must be one of:

* ``read_gguf`` returns the tensors, and they agree with the header's names and shapes;
* it raises :class:`pyloader.FormatError` or :class:`pyloader.UnsupportedError` whose
  message starts with the file's path.

Reading the header with its metadata values (``read_header(path, values=True)``, what
``load_model`` reads a GGUF file in place with) likewise returns or raises one of those.

Anything else is a failure: another exception type (a traceback), or the process dying on a
signal. Run as a script (``python tests/fuzz_gguf.py --cases N --seed S``); the case being
run is always the file ``case.gguf`` in the run's directory (``--keep-dir``), so the parent
can keep the file that killed a child. One JSON summary line is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
# value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
              BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}
# ggml types the generator writes: id -> (elements per block, bytes per block)
TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 30: (1, 2),
         10: (256, 84), 14: (256, 210), 12: (256, 144), 6: (32, 22), 24: (1, 1)}
SUPPORTED = {0, 1, 2, 3, 8, 30, 10, 14}
BOUNDARY = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 31, 32, 33, 64, 255, 256, 4096,
            2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 32, 2**62, 2**63 - 1, 2**63,
            U64_MAX - 31, U64_MAX - 1, U64_MAX]


class Raw(bytes):
    """A metadata value written verbatim."""


class Gguf:
    """A GGUF file being written, remembering where each header field is."""

    def __init__(self):
        self.buf = bytearray()
        self.fields: list[tuple[int, str, str]] = []  # (position, struct format, kind)

    def put(self, fmt: str, *vals, kind: str | None = None) -> None:
        if kind:
            self.fields.append((len(self.buf), fmt, kind))
        self.buf += struct.pack(fmt, *vals)

    def string(self, s: bytes | str, kind: str) -> None:
        b = s.encode() if isinstance(s, str) else s
        self.put("<Q", len(b), kind=kind)
        self.buf += b

    def value(self, vtype: int, v) -> None:
        if isinstance(v, Raw):
            self.buf += v
        elif vtype == STRING:
            self.string(v, "string length")
        elif vtype == ARRAY:
            etype, items = v
            self.put("<I", etype, kind="array type")
            self.put("<Q", len(items), kind="array length")
            for x in items:
                self.value(etype, x)
        else:
            self.put(SCALAR_FMT[vtype], v, kind="scalar")


def nested_array(depth: int) -> Raw:
    """An array value holding one array holding one ... (``depth`` levels), built without
    recursion."""
    return Raw(struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U8, 0))


def gguf_bytes(metadata: list[tuple], tensors: list[tuple], *, alignment: int = 32,
               version: int = 3, out: Gguf | None = None) -> bytes:
    """A GGUF file. ``metadata``: ``(key, value type, value)`` (an array value is
    ``(element type, [elements])``, or a :class:`Raw`); ``tensors``: ``(name, dims
    innermost first, ggml type, data[, offset])`` (offset relative to the data section;
    default: packed in order, each on the alignment). Nothing is checked: any field may
    lie."""
    g = out if out is not None else Gguf()
    g.put("<4sI", b"GGUF", version)
    g.put("<Q", len(tensors), kind="tensor count")
    g.put("<Q", len(metadata), kind="key count")
    for key, vtype, v in metadata:
        g.string(key, "key length")
        g.put("<I", vtype, kind="value type")
        g.value(vtype, v)
    placed = []
    running = 0
    for t in tensors:
        name, dims, ggml_type, data = t[:4]
        offset = t[4] if len(t) > 4 else running
        g.string(name, "tensor name length")
        g.put("<I", len(dims), kind="dimension count")
        for d in dims:
            g.put("<Q", d, kind="dimension")
        g.put("<I", ggml_type, kind="tensor type")
        g.put("<Q", offset, kind="tensor offset")
        placed.append((offset, data))
        running = max(running, offset + len(data))
        running += -running % max(alignment, 1)
    g.buf += bytes(-len(g.buf) % max(alignment, 1))
    placed = [(o, d) for o, d in placed if d]  # an empty tensor may point anywhere
    section = bytearray(max((o + len(d) for o, d in placed), default=0))
    for o, d in placed:
        section[o:o + len(d)] = d
    g.buf += section
    return bytes(g.buf)


# ----------------------------------------------------------------------------
# Valid files


def random_value(rng: random.Random, vtype: int):
    if vtype == STRING:
        return rng.choice(["", "llama", "gpt2", "é名", "x" * rng.randint(0, 40)])
    if vtype == BOOL:
        return rng.randint(0, 1)
    if vtype in (F32, F64):
        return rng.choice([0.0, 1e-5, 10000.0, -1.5])
    lo, hi = {U8: (0, 255), I8: (-128, 127), U16: (0, 65535), I16: (-32768, 32767),
              U32: (0, U32_MAX), I32: (-2**31, 2**31 - 1), U64: (0, U64_MAX),
              I64: (-2**63, 2**63 - 1)}[vtype]
    return rng.choice([lo, hi, 0, 1, rng.randint(lo, hi)])


def random_metadata(rng: random.Random) -> list[tuple]:
    md = [("general.architecture", STRING, "llama")]
    for i in range(rng.randint(0, 6)):
        vtype = rng.choice([U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, U64, I64, F64,
                            ARRAY, ARRAY])
        key = rng.choice(["general.name", "llama.block_count", "tokenizer.ggml.tokens",
                          "k", "", "é"]) + str(i)
        if vtype == ARRAY:
            etype = rng.choice([U8, I32, F32, STRING, STRING, BOOL, U64, ARRAY])
            if etype == ARRAY:
                v = (ARRAY, [(U8, [1, 2])] * rng.randint(0, 2))
            else:
                v = (etype, [random_value(rng, etype) for _ in range(rng.randint(0, 5))])
        else:
            v = random_value(rng, vtype)
        md.append((key, vtype, v))
    rng.shuffle(md)
    return md


def random_tensors(rng: random.Random) -> list[tuple]:
    out = []
    for i in range(rng.randint(0, 4)):
        ggml_type = rng.choice(list(TYPES)) if rng.randint(0, 4) == 0 else \
            rng.choice(sorted(SUPPORTED))
        block, nbytes = TYPES[ggml_type]
        n_dims = rng.choice([0, 1, 1, 2, 2, 3]) if block == 1 else rng.choice([1, 2, 2, 3])
        dims = [rng.choice([1, 2, 3]) for _ in range(n_dims)]
        if block > 1:
            dims[0] = block * rng.randint(1, 2)
        elements = 1
        for d in dims:
            elements *= d
        data = rng.randbytes(elements // block * nbytes)
        if ggml_type == 30:  # BF16: finite values (MLX reads it as float16)
            data = bytes(b & 0x3F if j % 2 else b for j, b in enumerate(data))
        suffix = ".weight" if rng.randint(0, 5) else rng.choice([".bias", ""])
        out.append((f"blk.{i}.t{rng.randint(0, 9)}{suffix}", dims, ggml_type, data))
    return out


def valid_file(rng: random.Random) -> tuple[bytes, Gguf]:
    md = random_metadata(rng)
    alignment = 32
    if rng.randint(0, 2) == 0:
        alignment = rng.choice([1, 2, 4, 8, 16, 32, 64, 256])
        md.insert(rng.randint(0, len(md)), ("general.alignment", U32, alignment))
    g = Gguf()
    data = gguf_bytes(md, random_tensors(rng), alignment=alignment, version=rng.choice([2, 3]),
                      out=g)
    return data, g


# ----------------------------------------------------------------------------
# Mutations


def mutate(rng: random.Random, data: bytes, g: Gguf) -> tuple[bytes, str]:
    kind = rng.choice(["field", "field", "field", "field", "bitflip", "byte", "truncate",
                       "extend", "splice", "structure"])
    buf = bytearray(data)
    if not buf:
        return data + b"GGUF", "extend"
    # A field still inside the file (an earlier mutation may have cut or shifted it).
    fields = [f for f in g.fields if f[0] + struct.calcsize(f[1]) <= len(buf)]
    header_end = max((p + struct.calcsize(f) for p, f, _ in fields), default=len(buf))
    if kind == "field" and fields:
        pos, fmt, what = rng.choice(fields)
        bits = struct.calcsize(fmt) * 8
        if what == "value type" or what == "array type":
            v = rng.choice([0, 7, 8, 9, 10, 12, 13, 255, U32_MAX])
        elif what == "tensor type":
            v = rng.choice([0, 1, 2, 4, 5, 12, 30, 31, 34, 39, 42, 255, U32_MAX])
        elif what == "dimension count":
            v = rng.choice([0, 1, 3, 4, 5, 8, 9, 64, U32_MAX])
        else:
            v = rng.choice(BOUNDARY + [rng.randint(0, 2**bits - 1)])
        v &= (1 << bits) - 1
        if fmt[-1] in "bhiq":  # signed scalar
            v -= (1 << bits) if v >= 1 << (bits - 1) else 0
        if fmt[-1] in "fd":
            v = float(v)
        struct.pack_into(fmt, buf, pos, v)
        return bytes(buf), f"field:{what}"
    if kind == "bitflip":
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(min(len(buf), header_end) if rng.randint(0, 3) else len(buf))
            buf[at] ^= 1 << rng.randint(0, 7)
        return bytes(buf), kind
    if kind == "byte":
        at = rng.randrange(min(len(buf), header_end))
        buf[at] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randint(0, 255)])
        return bytes(buf), kind
    if kind == "truncate":
        return data[:rng.randint(0, len(data) - 1)], kind
    if kind == "extend":
        return data + rng.choice([b"\0", rng.randbytes(rng.randint(1, 64))]), kind
    if kind == "splice":
        a, b = sorted((rng.randint(0, len(data)), rng.randint(0, len(data))))
        return data[:a] + data[b:], kind
    return structural(rng), "structure"


def structural(rng: random.Random) -> bytes:
    """A file whose structure (not one field) breaks a rule."""
    md = random_metadata(rng)
    tensors = random_tensors(rng) or [("w.weight", [32], 8, bytes(34))]
    which = rng.randint(0, 5)
    if which == 0:  # duplicate key
        md.append(md[rng.randrange(len(md))])
    elif which == 1:  # duplicate tensor name
        tensors.append(tensors[rng.randrange(len(tensors))])
    elif which == 2:  # deep nesting
        md.append(("nested", ARRAY, nested_array(rng.choice([2, 63, 64, 65, 1000, 5000]))))
    elif which == 3:  # overlapping data
        t = tensors[0]
        tensors.append(("overlap", t[1], t[2], t[3], 0))
    elif which == 4:  # an alignment that is not a power of two, or not a uint32
        vtype = rng.choice([U32, U32, U64, I32, STRING])
        value = rng.choice([0, 3, 24, 48, 2**31 - 1]) if rng.randint(0, 1) else 32
        md.append(("general.alignment", vtype, "32" if vtype == STRING else value))
    else:  # a quantized tensor MLX would name wrongly
        tensors.append((rng.choice(["q", "abcdefgh", "x.scales"]), [32], 2, bytes(18)))
        tensors.append(("x.weight", [32], 2, bytes(18)))
    return gguf_bytes(md, tensors)


def make_case(rng: random.Random) -> tuple[bytes, str]:
    data, g = valid_file(rng)
    if rng.randint(0, 9) == 0:
        return data, "valid"
    kinds = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        data, kind = mutate(rng, data, g)
        kinds.append(kind)
        if not data:
            break
    return data, "+".join(kinds)


# ----------------------------------------------------------------------------
# The oracle


class Failure(AssertionError):
    pass


def check(path: Path, counts: Counter) -> str:
    """Run one case (the file at ``path``); its outcome, or :class:`Failure`."""
    import mlx.core as mx

    import pyloader
    from pyloader.gguf import read_gguf
    from pyloader.io.gguf import QUANTIZED_TYPES
    from pyloader.io.gguf_header import read_header

    try:  # the metadata values, as load_model reads them in place
        read_header(path, values=True)
    except (pyloader.FormatError, pyloader.UnsupportedError) as e:
        if not str(e).startswith(str(path)):
            raise Failure(f"{type(e).__name__} does not name the file: {e}") from None
    except Exception as e:  # noqa: BLE001 - any other type is the bug under test
        raise Failure(f"read_header(values=True): {type(e).__name__}: {e}") from e
    try:
        weights, _metadata = read_gguf(path)
    except (pyloader.FormatError, pyloader.UnsupportedError) as e:
        if not str(e).startswith(str(path)):
            raise Failure(f"{type(e).__name__} does not name the file: {e}") from None
        rule = str(e)[len(str(path)) + 2:]
        if rule.startswith("MLX cannot read"):
            counts[f"mlx-refused:{rule[:90]}"] += 1
        return "format-error" if isinstance(e, pyloader.FormatError) else "unsupported"
    except Exception as e:  # noqa: BLE001 - any other type is the bug under test
        raise Failure(f"{type(e).__name__} (not a typed pyloader error): {e}") from e
    for name, t in read_header(path).tensors.items():
        got = weights[name]
        if t.type_name in QUANTIZED_TYPES:
            want = (*t.shape[:-1], t.shape[-1] // 32)
            got = weights[name[:-len(".weight")] + ".scales"]
        else:
            want = t.shape
        if tuple(got.shape) != want:
            raise Failure(f"tensor {name!r}: MLX's shape {tuple(got.shape)}, header's {want}")
    mx.eval(list(weights.values()))
    counts["tensors"] += len(weights)
    return "accepted"


def run(cases: int | None, seconds: float | None, seed: int, directory: Path) -> Counter:
    counts: Counter = Counter()
    rng = random.Random(seed)
    path = directory / "case.gguf"
    t0 = time.perf_counter()
    while (counts["cases"] < cases) if cases is not None else \
            (time.perf_counter() - t0 < seconds):
        data, kind = make_case(rng)
        path.write_bytes(data)
        try:
            outcome = check(path, counts)
        except Failure as e:
            raise Failure(f"case {counts['cases']} ({kind}): {e}\n  file: {data[:400]!r}") \
                from None
        counts[outcome] += 1
        counts["cases"] += 1
        counts[f"kind:{kind.split('+')[0].split(':')[0]}"] += 1
    path.unlink(missing_ok=True)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None, help="time box instead of a count")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep-dir", default=None, help="where case.gguf is written")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    print(f"fuzz seed {seed}", file=sys.stderr, flush=True)
    own = args.keep_dir is None
    directory = Path(args.keep_dir or tempfile.mkdtemp(prefix="pyloader-gguf-fuzz-"))
    t0 = time.perf_counter()
    try:
        counts = run(args.cases if args.seconds is None else None, args.seconds, seed,
                     directory)
    except Failure as e:
        print(f"FAILURE (seed {seed}): {e}", file=sys.stderr)
        return 1
    finally:
        if own:
            for p in directory.iterdir():
                p.unlink()
            os.rmdir(directory)
    print(json.dumps({"seed": seed, "seconds": round(time.perf_counter() - t0, 1), **counts},
                     sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
