"""Mutational fuzzing of GGUF conversion (``convert_gguf`` and ``pyloader convert-gguf``)
over what a valid file may still get wrong: metadata values and tensor names.

Each case is a valid tiny GGUF file, a llama or another architecture read in place (a
mixture of experts among them; random sizes, F32/F16 tensors and Q8_0/Q4_0 weights, a
byte-level BPE vocabulary; written with tests/fuzz_gguf.py's raw writer, so any value may
have any GGUF type) that is then mutated:
a metadata value replaced by one of another type or a boundary value (0, -1, 2**64 - 1,
NaN, infinity, a string, an array), a key dropped, the vocabulary, merges, token types or
special token ids made inconsistent, a tensor renamed (MLX's ``.scales``/``.biases``, a
block beyond the count, ``blk.01``, a non-ASCII digit, a name without a suffix), dropped,
reshaped or requantized. The verdict of every case must be one of:

* the conversion succeeds and mlx-lm loads the result (strictly: every weight of its
  model and nothing else), its forward pass runs, and the tokenizer file loads;
* it raises :class:`pyloader.FormatError` or :class:`pyloader.UnsupportedError` whose
  message starts with the file's path, having written nothing.

``load_model(path, kernels="auto")`` reads the same file in place: its model computes, or
it refuses with such an error; a file the conversion accepts it accepts too.
``pyloader convert-gguf`` on the same file exits 0, or 1 with one line on stderr. Anything
else (another exception type, a converted model mlx-lm cannot load, a traceback from the
command) is a failure. ``python tests/fuzz_gguf_convert.py --cases N --seed S`` replays a
run; one JSON summary line is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import fuzz_gguf as fz
from fuzz_gguf import ARRAY, BOOL, F32, I32, I64, STRING, U32, U64

F32_TYPE, F16_TYPE, Q4_0, Q8_0 = 0, 1, 2, 8
BLOCK_BYTES = {Q4_0: 18, Q8_0: 34}
TOKENS = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
          + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġa", "ab"])
MERGES = ["Ġ a", "a b"]


def _floats(rng: random.Random, n: int, fmt: str) -> bytes:
    return struct.pack(f"<{n}{fmt}", *(rng.uniform(-0.1, 0.1) for _ in range(n)))


def tensor(rng: random.Random, name: str, shape: tuple[int, ...], quantize: bool) -> tuple:
    """``(name, dims innermost first, ggml type, data)``; a 2-D tensor (or a 3-D stack of
    experts) whose rows are whole blocks may be Q8_0 or Q4_0."""
    n = 1
    for d in shape:
        n *= d
    if quantize and len(shape) in (2, 3) and shape[-1] % 32 == 0:
        ggml_type = rng.choice([Q8_0, Q4_0])
        blocks = n // 32
        data = b"".join(struct.pack("<e", rng.uniform(0.001, 0.01))
                        + rng.randbytes(BLOCK_BYTES[ggml_type] - 2) for _ in range(blocks))
        return (name, list(reversed(shape)), ggml_type, data)
    if rng.randint(0, 3) == 0:
        return (name, list(reversed(shape)), F16_TYPE, _floats(rng, n, "e"))
    return (name, list(reversed(shape)), F32_TYPE, _floats(rng, n, "f"))


#: Architectures read in place besides llama (which alone converts): each case is a llama
#: half the time, else one of these with its own tensors and keys (a mixtral is a llama with
#: experts).
OTHER_ARCHS = ("qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "mixtral")


def model_case(rng: random.Random, arch: str | None = None) -> tuple[list, list]:
    """A valid tiny ``arch`` (by default a llama half the time, else one of
    :data:`OTHER_ARCHS`): ``(metadata, tensors)`` for :func:`fuzz_gguf.gguf_bytes`."""
    if arch is None:
        arch = "llama" if rng.randint(0, 1) else rng.choice(OTHER_ARCHS)
    experts = arch in ("qwen3moe", "mixtral")
    hidden, n_head = rng.choice([32, 64]), rng.choice([2, 4])
    n_kv = rng.choice([k for k in (1, 2, 4) if n_head % k == 0])
    head_dim, ffn, n_layer = hidden // n_head, rng.choice([32, 64, 96]), rng.randint(1, 2)
    if arch == "gemma3":  # mlx-lm's gemma3 has a global layer every 6 (fewer: refused)
        n_layer = rng.choice([6, 6, 1])
    vocab = len(TOKENS) + rng.choice([0, 0, 3])
    quantize = rng.randint(0, 1) == 1
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if rng.randint(0, 1):
        shapes["output.weight"] = (vocab, hidden)
    q, kv = n_head * head_dim, n_kv * head_dim
    for i in range(n_layer):
        b = f"blk.{i}"
        shapes.update({
            f"{b}.attn_norm.weight": (hidden,), f"{b}.ffn_norm.weight": (hidden,),
            f"{b}.attn_q.weight": (q, hidden), f"{b}.attn_k.weight": (kv, hidden),
            f"{b}.attn_v.weight": (kv, hidden), f"{b}.attn_output.weight": (hidden, q),
            f"{b}.ffn_gate.weight": (ffn, hidden), f"{b}.ffn_up.weight": (ffn, hidden),
            f"{b}.ffn_down.weight": (hidden, ffn)})
        if arch == "qwen2":
            shapes.update({f"{b}.attn_q.bias": (q,), f"{b}.attn_k.bias": (kv,),
                           f"{b}.attn_v.bias": (kv,)})
        if experts:
            if i == 0:
                n_exp, eff = rng.choice([2, 4]), rng.choice([32, 64])
            for name in ("ffn_gate", "ffn_up", "ffn_down"):
                del shapes[f"{b}.{name}.weight"]
            shapes.update({f"{b}.ffn_gate_inp.weight": (n_exp, hidden),
                           f"{b}.ffn_gate_exps.weight": (n_exp, eff, hidden),
                           f"{b}.ffn_up_exps.weight": (n_exp, eff, hidden),
                           f"{b}.ffn_down_exps.weight": (n_exp, hidden, eff)})
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            shapes.update({f"{b}.attn_q_norm.weight": (head_dim,),
                           f"{b}.attn_k_norm.weight": (head_dim,)})
        if arch in ("gemma2", "gemma3"):
            shapes.update({f"{b}.post_attention_norm.weight": (hidden,),
                           f"{b}.post_ffw_norm.weight": (hidden,)})
        if arch == "phi3":
            for name in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
                del shapes[f"{b}.{name}.weight"]
            shapes.update({f"{b}.attn_qkv.weight": (q + 2 * kv, hidden),
                           f"{b}.ffn_up.weight": (2 * ffn, hidden)})
    if arch == "gemma2":
        shapes.pop("output.weight", None)  # mlx-lm's gemma2 ties its output
    tensors = [tensor(rng, name, shape, quantize) for name, shape in shapes.items()]
    a = "llama" if arch == "mixtral" else arch
    metadata = [
        ("general.architecture", STRING, a),
        ("general.name", STRING, "fuzz"),
        (f"{a}.block_count", U32, n_layer),
        (f"{a}.embedding_length", U32, hidden),
        (f"{a}.feed_forward_length", U32, ffn),
        (f"{a}.attention.head_count", U32, n_head),
        (f"{a}.attention.head_count_kv", U32, n_kv),
        (f"{a}.context_length", U32, 256),
        (f"{a}.rope.freq_base", F32, 10000.0),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, rng.choice(["smollm", "default"])),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, list(TOKENS))),
        ("tokenizer.ggml.merges", ARRAY, (STRING, list(MERGES))),
        ("tokenizer.ggml.token_type", ARRAY, (I32, [3, 3, 3] + [1] * (len(TOKENS) - 3))),
        ("tokenizer.ggml.bos_token_id", U32, 1),
        ("tokenizer.ggml.eos_token_id", U32, 2),
    ]
    if rng.randint(0, 1):
        metadata.append((f"{a}.attention.key_length", U32, head_dim))
    if experts:
        metadata += [(f"{a}.expert_count", U32, n_exp),
                     (f"{a}.expert_used_count", U32, rng.randint(1, n_exp)),
                     (f"{a}.expert_feed_forward_length", U32, eff)]
    if arch == "phi3" and rng.randint(0, 1):
        metadata.append((f"{a}.rope.dimension_count", U32, rng.choice([2, head_dim // 2])))
    if arch == "gemma2":
        metadata += [(f"{a}.attn_logit_softcapping", F32, 50.0),
                     (f"{a}.final_logit_softcapping", F32, 30.0)]
    if arch == "gemma3":
        metadata.append((f"{a}.attention.sliding_window", U32, rng.choice([1, 4, 512])))
    if rng.randint(0, 2) == 0:
        metadata.append(("tokenizer.chat_template", STRING, "{{ messages }}"))
    rng.shuffle(metadata)
    return metadata, tensors


# ----------------------------------------------------------------------------
# Mutations

#: (value type, value): every GGUF type, and the values at the edges of each rule.
HOSTILE = [(U32, 0), (U32, 1), (U32, 3), (U32, 7), (U32, 2**32 - 1), (I32, -1), (I32, 0),
           (I64, -(2**63)), (U64, 2**64 - 1), (U64, 2**63), (F32, float("nan")),
           (F32, float("inf")), (F32, float("-inf")), (F32, 0.0), (F32, -1e-6), (F32, 1e-38),
           (F32, 2.0), (STRING, "2"), (STRING, ""), (STRING, "llama"), (BOOL, 1),
           (ARRAY, (U32, [2, 2])), (ARRAY, (STRING, [])), (ARRAY, (STRING, ["a"])),
           (ARRAY, (I32, [1, 2, 3])), (ARRAY, (F32, [1.0]))]


def mutate_value(rng: random.Random, metadata: list) -> str:
    i = rng.randrange(len(metadata))
    key = metadata[i][0]
    vtype, value = rng.choice(HOSTILE)
    metadata[i] = (key, vtype, value)
    return "value"


def mutate_tokenizer(rng: random.Random, metadata: list) -> str:
    """The vocabulary and what refers into it made inconsistent."""
    keys = {m[0]: i for i, m in enumerate(metadata)}
    n = len(TOKENS)
    edits = [
        ("tokenizer.ggml.tokens", ARRAY, (STRING, TOKENS + ["a"])),         # a duplicate
        ("tokenizer.ggml.tokens", ARRAY, (STRING, TOKENS[:-1] + [""])),     # an empty token
        ("tokenizer.ggml.tokens", ARRAY, (STRING, TOKENS + ["x"] * 40)),    # past the rows
        ("tokenizer.ggml.tokens", ARRAY, (I32, list(range(n)))),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["q é"])),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["a c"])),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["a  b", " ", ""])),
        ("tokenizer.ggml.merges", ARRAY, (U32, [1, 2])),
        ("tokenizer.ggml.token_type", ARRAY, (I32, [1] * (n - 1))),
        ("tokenizer.ggml.token_type", ARRAY, (STRING, ["1"] * n)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, [2] * n)),
        ("tokenizer.ggml.unknown_token_id", U32, rng.choice([0, n - 1, n, 2**32 - 1])),
        ("tokenizer.ggml.bos_token_id", I32, rng.choice([-1, n, n + 3])),
        ("tokenizer.ggml.eos_token_id", U64, 2**64 - 1),
        ("tokenizer.ggml.padding_token_id", U32, n),
        ("tokenizer.ggml.add_bos_token", STRING, "yes"),
        ("tokenizer.chat_template", U32, 7),
        ("tokenizer.ggml.model", STRING, rng.choice(["llama", "bert", ""])),
        ("tokenizer.ggml.pre", ARRAY, (STRING, ["smollm"])),
    ]
    key, vtype, value = rng.choice(edits)
    entry = (key, vtype, value)
    if key in keys:
        metadata[keys[key]] = entry
    else:
        metadata.append(entry)
    return "tokenizer"


def rename_pool(rng: random.Random, name: str) -> str:
    base, _, part = name.rpartition(".")
    block = base.split(".")
    return rng.choice([
        f"{base}.scales", f"{base}.biases", f"{base}.bias", base, "", "output.weight",
        "blk.99.attn_q.weight", "blk.01.attn_q.weight", "blk.١.ffn_up.weight",
        "blk.0.attn_q.weight", "rope_freqs.weight", "blk.0.ffn_up.bias",
        f"{'.'.join(block[:2])}.unknown.{part}" if len(block) > 2 else "unknown.weight",
        name + ".weight", name.upper(), "blk.-1.attn_q.weight", "blk.0.attn_q.weight.weight",
        "blk.0.ffn_gate.0.weight", "blk.0.ffn_up_exps.weight",
    ])


def mutate_tensors(rng: random.Random, tensors: list) -> str:
    i = rng.randrange(len(tensors))
    name, dims, ggml_type, data = tensors[i]
    kind = rng.choice(["name", "name", "drop", "shape", "type", "add"])
    if kind == "name":
        new = rename_pool(rng, name)
        others = [k for k, t in enumerate(tensors) if t[0] == new and k != i]
        if others:  # the header refuses duplicates: this one takes the other's place
            tensors[others[0]] = (new, dims, ggml_type, data)
            del tensors[i]
        else:
            tensors[i] = (new, dims, ggml_type, data)
    elif kind == "drop":
        del tensors[i]
    elif kind == "shape":  # another shape of the same element count, or another count
        shape = tuple(reversed(dims))
        n = 1
        for d in shape:
            n *= d
        choices = [(n,), (1, n), tuple(reversed(shape)) if len(shape) > 1 else (n, 1),
                   (shape[0] + 1,) + shape[1:], (32,) * len(shape)]
        tensors[i] = tensor(rng, name, rng.choice(choices), ggml_type != F32_TYPE)
    elif kind == "type":
        tensors[i] = tensor(rng, name, tuple(reversed(dims)), True)
    else:  # a tensor that is not llama's
        tensors.append(tensor(rng, rename_pool(rng, name), (8,), False))
        seen = set()
        tensors[:] = [t for t in tensors if not (t[0] in seen or seen.add(t[0]))]
    return kind if kind != "add" else "name"


def make_case(rng: random.Random) -> tuple[bytes, str]:
    metadata, tensors = model_case(rng)
    if rng.randint(0, 9) == 0:
        return fz.gguf_bytes(metadata, tensors), "valid"
    kinds = []
    for _ in range(rng.choice([1, 1, 2])):
        what = rng.choice(["value", "value", "drop-key", "tokenizer", "tokenizer", "tensor",
                           "tensor"])
        if what == "value":
            kinds.append(mutate_value(rng, metadata))
        elif what == "drop-key":
            del metadata[rng.randrange(len(metadata))]
            kinds.append("drop-key")
        elif what == "tokenizer":
            kinds.append(mutate_tokenizer(rng, metadata))
        elif tensors:
            kinds.append(mutate_tensors(rng, tensors))
    return fz.gguf_bytes(metadata, tensors), "+".join(kinds) or "valid"


# ----------------------------------------------------------------------------
# The oracle


def _loads(out: Path) -> None:
    """mlx-lm loads the converted model strictly, a forward pass runs, the tokenizer file
    loads: raises :class:`fuzz_gguf.Failure` otherwise."""
    import mlx.core as mx
    from mlx_lm.utils import load_model
    from tokenizers import Tokenizer

    try:
        model, _config = load_model(out)
        mx.eval(model(mx.array([[0, 1]])))
        Tokenizer.from_file(str(out / "tokenizer.json"))
    except BaseException as e:  # what mlx-lm raises is the finding
        if isinstance(e, KeyboardInterrupt):
            raise
        raise fz.Failure(f"converted, but mlx-lm cannot use it: {type(e).__name__}: {e}") \
            from None


def _cli(path: Path, out: Path) -> int:
    """``pyloader convert-gguf PATH OUT``: its status, after checking that it printed at
    most one line on stderr and raised nothing."""
    from pyloader.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = main(["convert-gguf", str(path), str(out)])
    except BaseException as e:  # the command must not raise
        if isinstance(e, KeyboardInterrupt):
            raise
        raise fz.Failure(f"pyloader convert-gguf raised {type(e).__name__}: {e}") from None
    text = err.getvalue()
    if status not in (0, 1) or (status == 1 and (text.count("\n") != 1 or not text.startswith(
            "pyloader convert-gguf: "))):
        raise fz.Failure(f"pyloader convert-gguf exited {status} with {text!r}")
    return status


def _in_place(path: Path) -> str:
    """``load_model(path)`` reading the file in place: a model that computes, or a typed
    error naming the file."""
    import mlx.core as mx

    import pyloader

    try:
        model, _ = pyloader.load_model(path, kernels="auto")
    except (pyloader.FormatError, pyloader.UnsupportedError) as e:
        if not str(e).startswith(f"{path}: "):
            raise fz.Failure(f"load_model: {type(e).__name__} does not name the file: {e}") \
                from None
        return "refused"
    except BaseException as e:  # any other type is the bug
        if isinstance(e, KeyboardInterrupt):
            raise
        raise fz.Failure(f"load_model: {type(e).__name__} (not a typed pyloader error): "
                         f"{e}") from None
    mx.eval(model(mx.array([[0]])))
    return "accepted"


def check(path: Path, work: Path, counts: Counter) -> str:
    """Run one case (the file at ``path``, outputs under ``work``); its outcome, or
    :class:`fuzz_gguf.Failure`."""
    import pyloader
    from pyloader.gguf import convert_gguf

    out = work / "out"
    for p in (out, work / "cli"):
        shutil.rmtree(p, ignore_errors=True)
    try:
        convert_gguf(path, out)
    except (pyloader.FormatError, pyloader.UnsupportedError) as e:
        if not str(e).startswith(f"{path}: "):
            raise fz.Failure(f"{type(e).__name__} does not name the file: {e}") from None
        if out.exists():
            raise fz.Failure(f"{type(e).__name__} after writing {out}: {e}")
        verdict = "format-error" if isinstance(e, pyloader.FormatError) else "unsupported"
        counts[f"rule:{str(e)[len(str(path)) + 2:][:60]}"] += 1
    except BaseException as e:  # any other type is the bug
        if isinstance(e, KeyboardInterrupt):
            raise
        raise fz.Failure(f"{type(e).__name__} (not a typed pyloader error): {e}") from None
    else:
        _loads(out)
        verdict = "accepted"
    in_place = _in_place(path)
    counts[f"in-place:{in_place}"] += 1
    if verdict == "accepted" and in_place != "accepted":
        raise fz.Failure("convert_gguf accepts the file, but load_model refuses it in place")
    status = _cli(path, work / "cli")
    if status != (0 if verdict == "accepted" else 1):
        raise fz.Failure(f"convert_gguf: {verdict}, but pyloader convert-gguf exited {status}")
    return verdict


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
            outcome = check(path, directory, counts)
        except fz.Failure as e:
            raise fz.Failure(f"case {counts['cases']} ({kind}): {e}") from None
        counts[outcome] += 1
        counts["cases"] += 1
        for k in set(kind.split("+")):
            counts[f"kind:{k}"] += 1
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
    directory = Path(args.keep_dir or tempfile.mkdtemp(prefix="pyloader-gguf-convert-fuzz-"))
    t0 = time.perf_counter()
    try:
        counts = run(args.cases if args.seconds is None else None, args.seconds, seed,
                     directory)
    except fz.Failure as e:
        print(f"FAILURE (seed {seed}): {e}", file=sys.stderr)
        return 1
    finally:
        if own:
            shutil.rmtree(directory, ignore_errors=True)
    summary = {k: v for k, v in counts.items() if not k.startswith("rule:")}
    summary["rules"] = len([k for k in counts if k.startswith("rule:")])
    print(json.dumps({"seed": seed, "seconds": round(time.perf_counter() - t0, 1), **summary},
                     sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
