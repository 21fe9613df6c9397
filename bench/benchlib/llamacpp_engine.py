"""llama.cpp's half of bench/llama_cpp.py, run by the Python that has llama-cpp-python.

This script imports only the standard library, numpy, ``gguf`` and ``llama_cpp``, so it
runs in an environment of its own (llama.cpp is never a dependency of pyloader). It is
driven by bench/llama_cpp.py; each command prints one JSON object on its last stdout line.

Commands:

* ``write-gguf SRC_DIR OUT --type f32|f16|bf16``: the llama checkpoint in SRC_DIR (an
  mlx-lm/Hugging Face directory with one float16 ``model.safetensors`` and
  ``config.json``) as a GGUF file with the same values: llama.cpp's tensor names, Q and
  K rows permuted the way llama.cpp's ``convert_hf_to_gguf.py`` does for its llama
  architecture (llama.cpp's RoPE pairs adjacent elements of a head, Hugging Face's pairs
  element i with i + head_dim/2), norms in float32, and the vocabulary as ``"none"``:
  the benchmark feeds token ids, so llama.cpp needs only their count.
* ``quantize SRC OUT --ftype q4_0|q4_1|q5_0|q5_1|q8_0``: ``llama_model_quantize`` with
  ``pure`` set, so every 2-D tensor (token embeddings and output head included) gets that
  type, as mlx-lm's ``quantize`` does; llama.cpp's default mix would keep the output head
  in Q6_K. ``q2_k|q3_k_m|q4_k_m|q5_k_m|q6_k``: llama.cpp's own mixes.
* ``measure GGUF --tokens ...``: load, warm up, time a prefill and a greedy decode (see
  :func:`measure`); ``--logits FILE`` also saves the last prompt token's logits (.npy).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import struct
import sys
import time
from pathlib import Path

import numpy as np

# Run by path, this file's directory comes first on sys.path; keep it from shadowing packages.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

# (Hugging Face name suffix, GGUF name) of a llama decoder layer's tensors.
_LAYER = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
)
_GLOBAL = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
)
#: ``quantize`` types given to every matrix (``pure``).
PURE_FTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
_ST_DTYPES = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16}


def gguf_names(n_layers: int) -> list[tuple[str, str]]:
    """(checkpoint name, GGUF name) of every tensor of an untied llama."""
    names = list(_GLOBAL)
    for i in range(n_layers):
        names += [(f"model.layers.{i}.{hf}", f"blk.{i}.{gg}") for hf, gg in _LAYER]
    return names


def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a Q or K projection (``n_heads`` heads) reordered from Hugging Face's
    half-split RoPE pairing to llama.cpp's adjacent pairing: within each head, rows
    ``[0..d/2)`` and ``[d/2..d)`` are interleaved."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    return (w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file as read-only memory maps."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        if t["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {t['dtype']}, "
                             f"expected one of {sorted(_ST_DTYPES)}")
        start, end = t["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[t["dtype"]])
        out[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + start,
                              shape=tuple(t["shape"])) if end > start else \
            np.zeros(t["shape"], dtype)
    return out


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float values (round to nearest even; exact for values that are
    bfloat16 already)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
            >> np.uint32(16)).astype(np.uint16)


def write_gguf(src: Path, out: Path, kind: str, *, permute: bool = True) -> dict:
    """Writes ``src``'s llama checkpoint as GGUF ``out`` (see the module doc);
    ``permute=False`` leaves Q and K as they are (a wrong file, for tests to catch)."""
    import gguf

    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama" or config.get("tie_word_embeddings"):
        raise ValueError(f"{src}/config.json: expected an untied llama (model_type "
                         f"'llama', tie_word_embeddings false)")
    if config.get("rope_scaling"):
        raise ValueError(f"{src}/config.json: rope_scaling is not written to GGUF here")
    tensors = read_safetensors(src / "model.safetensors")
    n_layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16}[kind]

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(src.name)
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(ftype)
    w.add_tokenizer_model("none")

    def stored(a: np.ndarray) -> tuple[np.dtype, object]:
        """The numpy dtype of ``a`` as written, and its GGML type when numpy has none."""
        if a.ndim == 1 or kind == "f32":
            return np.dtype(np.float32), None
        if kind == "bf16":
            return np.dtype(np.uint16), gguf.GGMLQuantizationType.BF16
        return np.dtype(np.float16), None

    def converted(hf: str) -> np.ndarray:
        a = tensors[hf]
        if permute and hf.endswith("q_proj.weight"):
            a = rope_permute(a, heads)
        elif permute and hf.endswith("k_proj.weight"):
            a = rope_permute(a, kv_heads)
        dtype, raw = stored(a)
        return _to_bf16_bits(a) if raw is not None else np.asarray(a, dtype)

    plan = gguf_names(n_layers)
    missing = [hf for hf, _ in plan if hf not in tensors]
    if missing:
        raise ValueError(f"{src}/model.safetensors: missing {missing[:3]}")
    for hf, name in plan:
        a = tensors[hf]
        dtype, raw = stored(a)
        w.add_tensor_info(name, a.shape, dtype, a.size * dtype.itemsize, raw_dtype=raw)
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for hf, _ in plan:
        w.write_tensor_data(converted(hf))
    w.close()
    os.replace(tmp, out)
    return {"path": str(out), "bytes": out.stat().st_size}


def peak_rss() -> int:
    """This process's peak resident set in bytes: ``VmHWM`` (Linux's ``ru_maxrss`` carries
    the parent's peak across fork and exec), else ``ru_maxrss`` (bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _lib():
    # bench/ on the path (PYTHONPATH=bench, as the tests set it) would make
    # bench/llama_cpp.py the module imported here.
    bench = Path(__file__).resolve().parents[1]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != bench]
    import llama_cpp

    return llama_cpp


def quantize(src: Path, out: Path, ftype: str) -> dict:
    """``llama_model_quantize`` of the F16 GGUF ``src`` to ``ftype``."""
    ll = _lib()
    params = ll.llama_model_quantize_default_params()
    params.ftype = {"q4_0": ll.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_1": ll.LLAMA_FTYPE_MOSTLY_Q4_1,
                    "q5_0": ll.LLAMA_FTYPE_MOSTLY_Q5_0, "q5_1": ll.LLAMA_FTYPE_MOSTLY_Q5_1,
                    "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
                    "q2_k": ll.LLAMA_FTYPE_MOSTLY_Q2_K,
                    "q3_k_m": ll.LLAMA_FTYPE_MOSTLY_Q3_K_M,
                    "q4_k_m": ll.LLAMA_FTYPE_MOSTLY_Q4_K_M,
                    "q5_k_m": ll.LLAMA_FTYPE_MOSTLY_Q5_K_M,
                    "q6_k": ll.LLAMA_FTYPE_MOSTLY_Q6_K}[ftype]
    # The formats before K-quants everywhere (as mlx-lm quantizes every matrix); the
    # K-quant mixes as llama.cpp makes them for its users.
    params.pure = ftype in PURE_FTYPES
    params.nthread = os.cpu_count() or 1
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    rc = ll.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
    os.replace(tmp, out)
    return {"path": str(out), "bytes": out.stat().st_size}


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor, except that the token
    embedding table contributes one row."""
    import gguf

    reader = gguf.GGUFReader(path)
    total = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            n //= int(t.shape[-1])  # GGUF shapes are innermost first: [hidden, vocab]
        total += n
    return total


# The matrix weights of a llama (what llama.cpp's CPU buffer types may repack).
_MATMUL_WEIGHTS = (rb"^(blk\.[0-9]+\.(attn_[qkv]|attn_output|ffn_gate|ffn_up|ffn_down)"
                   rb"|output)\.weight$")


# The types of this file set that llama.cpp's AMX buffer type takes.
_AMX_TYPES = ("Q4_0", "Q8_0")


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def extra_buffer_types(ll) -> dict[str, int]:
    """llama.cpp's extra CPU buffer types on this machine (name -> handle), e.g.
    ``CPU_REPACK`` (weights re-laid out for its SIMD kernels) and ``AMX``."""
    libdir = Path(ll.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(libdir / "libggml.so"))
    base = ctypes.CDLL(str(libdir / "libggml-base.so"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    fn = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev),
                                                b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return {}
    arr = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    out, i = {}, 0
    while arr and arr[i]:
        out[base.ggml_backend_buft_name(arr[i]).decode()] = arr[i]
        i += 1
    return out


def _matmul_type(path: Path) -> str:
    import gguf

    for t in gguf.GGUFReader(path).tensors:
        if t.name == "blk.0.attn_q.weight":
            return t.tensor_type.name
    raise ValueError(f"{path}: no blk.0.attn_q.weight")


class Engine:
    """One llama.cpp model and context on ``threads`` threads.

    llama.cpp's AMX buffer type is kept out: in this llama-cpp-python build it crashes
    (SIGSEGV) on any batch of more than one token. Its weights go where a machine without
    AMX puts them: Q4_0 matrices to ``CPU_REPACK`` (llama.cpp's re-laid-out Q4_0 kernels),
    Q8_0 ones to the plain CPU buffer; F16 and BF16 keep the default (AMX does not take
    them). ``buffers`` says which.
    """

    def __init__(self, path: Path, threads: int, n_ctx: int):
        ll = self.ll = _lib()
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        bufts = extra_buffer_types(ll)
        self.buffers = "default (" + ", ".join(["CPU", *bufts]) + ")"
        kind = _matmul_type(path) if "AMX" in bufts else None
        if kind in _AMX_TYPES:
            if kind == "Q4_0" and "CPU_REPACK" in bufts:
                self._overrides = (_BuftOverride * 2)(
                    _BuftOverride(_MATMUL_WEIGHTS, bufts["CPU_REPACK"]), _BuftOverride())
                mp.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
                self.buffers = "CPU_REPACK (AMX skipped)"
            else:
                mp.use_extra_bufts = False
                self.buffers = "CPU (AMX skipped)"
        self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def reset(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Appends ``tokens`` to the sequence; the last one's logits (a view until the
        next call)."""
        arr = (self.ll.llama_token * len(tokens))(*tokens)
        rc = self.ll.llama_decode(self.ctx, self.ll.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.ll.llama_synchronize(self.ctx)
        ptr = self.ll.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))


def measure(path: Path, tokens: list[int], *, prefill: int, decode: int, context: int,
            warmup: int, threads: int, logits: Path | None) -> dict:
    """Warm-up (``warmup`` prompt tokens and one step), then the prefill of
    ``tokens[:prefill]`` and, from a fresh sequence of ``tokens[:context]``, ``decode``
    greedy steps (argmax included), each timed alone."""
    eng = Engine(path, threads, n_ctx=max(prefill, context + decode) + 64)
    out: dict = {"n_vocab": eng.n_vocab, "buffers": eng.buffers}
    if warmup:
        eng.eval([int(np.argmax(eng.eval(tokens[:warmup])))])
        eng.reset()
    t0 = time.perf_counter()
    last = eng.eval(tokens[:prefill])
    out["prefill_s"] = time.perf_counter() - t0
    if logits is not None:
        np.save(logits, np.array(last, dtype=np.float32))
    eng.reset()
    y = eng.eval(tokens[:context])
    greedy = []
    t0 = time.perf_counter()
    for _ in range(decode):
        tok = int(np.argmax(y))
        greedy.append(tok)
        y = eng.eval([tok])
    out["decode_s"] = time.perf_counter() - t0
    out["greedy"] = greedy
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-gguf")
    w.add_argument("src", type=Path)
    w.add_argument("out", type=Path)
    w.add_argument("--type", choices=("f32", "f16", "bf16"), default="f16")
    w.add_argument("--no-rope-permute", action="store_true", help=argparse.SUPPRESS)
    q = sub.add_parser("quantize")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--ftype", choices=(*PURE_FTYPES, "q2_k", "q3_k_m", "q4_k_m", "q5_k_m",
                                       "q6_k"), required=True)
    m = sub.add_parser("measure")
    m.add_argument("gguf", type=Path)
    m.add_argument("--tokens", required=True, help="comma-separated prompt token ids")
    m.add_argument("--prefill", type=int, required=True)
    m.add_argument("--decode", type=int, required=True)
    m.add_argument("--context", type=int, required=True)
    m.add_argument("--warmup", type=int, default=8)
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--logits", type=Path)
    sub.add_parser("info")
    args = ap.parse_args(argv)

    if args.cmd == "write-gguf":
        result = write_gguf(args.src, args.out, args.type, permute=not args.no_rope_permute)
    elif args.cmd == "quantize":
        result = quantize(args.src, args.out, args.ftype)
    elif args.cmd == "measure":
        tokens = [int(t) for t in args.tokens.split(",")]
        result = measure(args.gguf, tokens, prefill=args.prefill, decode=args.decode,
                         context=args.context, warmup=args.warmup, threads=args.threads,
                         logits=args.logits)
        result["weight_bytes_per_token"] = weight_bytes_per_token(args.gguf)
        result["peak_rss"] = peak_rss()
    else:
        ll = _lib()
        result = {"llama_cpp_python": ll.__version__,
                  "system_info": ll.llama_print_system_info().decode().strip()}
    sys.stdout.flush()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
