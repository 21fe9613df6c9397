"""pyloader's CPU kernels against llama.cpp: the same random weights in both engines.

    PYLOADER_LLAMA_CPP_PYTHON=/path/to/python python bench/llama_cpp.py [--shape tinyllama-1.1b]
    python bench/llama_cpp.py --levels all      # each SIMD level against llama.cpp built for it
    python bench/llama_cpp.py --report          # the table of every results JSON

With ``--levels`` (``all``, or some of ``avx2,avx512,amx``), every level this CPU has is
measured in the same run, interleaved: pyloader's kernels forced to it
(``PYLOADER_KERNEL_ISA``) against llama.cpp built for it -- llama-cpp-python
:data:`LLAMA_CPP_PYTHON_VERSION` compiled from PyPI with ``GGML_NATIVE=OFF`` and that
level's ``GGML_*`` flags only (:func:`ggml_flags`), in a virtual environment of its own
under ``$PYLOADER_CACHE/llama-cpp-python/<level>/`` (built on first use: minutes). One
results file per level, ``llama-cpp-<shape>-<level>.json``.

One llama checkpoint of a named shape is generated with a fixed seed (every weight a
value that float16 and bfloat16 both hold exactly, norms 1) and written once, under
``$PYLOADER_CACHE/llama-cpp-bench/<shape>/`` (default ``~/.cache/pyloader``):

* as mlx-lm directories: float16 (the source of all others), bfloat16, and mlx-lm's
  4-bit and 8-bit affine quantization with groups of 64 and float16 scales and biases
  (``mlx_lm.convert -q --q-group-size 64 --dtype float16``);
* as GGUF, by bench/benchlib/llamacpp_engine.py in the llama.cpp Python: F16 and BF16 with the
  same values, and Q4_0 and Q8_0 quantized from the F16 file by
  ``llama_model_quantize`` (blocks of 32, a float16 scale each: 4.5 and 8.5 bits per
  weight, as 4 and 8 bits with a float16 scale and bias per 64).

Before measuring, the F16 GGUF and the float16 directory (written whatever the formats)
compute the logits of one prompt in both engines; they must agree
(:data:`LOGITS_TOLERANCE`), or the run stops: that is the check that both engines hold
the same weights. (BF16 logits would not do: with activations rounded to bfloat16 the
engines' logits of the 8B shape differ by 12% of the largest.)

Each measurement first evicts its engine's files from the page cache and reads them back
(``pyloader.io.pagecache.recache``), then runs in a fresh subprocess on ``--threads``
threads (llama.cpp's ``n_threads`` and ``n_threads_batch``; pyloader's
``PYLOADER_KERNEL_THREADS``): warm-up, then the prefill of a ``--prefill``-token prompt
and ``--decode`` greedy steps after a 16-token prompt, each timed alone, and the process's
peak RSS. Runs are interleaved (every engine and format once, then again) and summarised
by medians; a ratio to llama.cpp is the median of each round's ratio (the two engines
measured minutes apart at most). Engines: llama.cpp,
mlx-lm with ``load_model(kernels="auto")``, and -- at shapes up to 1.1B
parameters -- ``kernels="mlx"`` (MLX's own ops) on fewer tokens (``--mlx-prefill``,
``--mlx-decode``, no warm-up) in the first ``--mlx-runs`` rounds only: its 4-bit and 8-bit
products with float16 scales take about half a minute per token at 1.1B.

With ``--gguf`` the engines are llama.cpp and pyloader reading the same GGUF file in place
(``load_model("x.gguf")``, docs/gguf.md), and the formats may include llama.cpp's K-quant
mixes ``q4_k_m``, ``q5_k_m`` and ``q6_k`` (``llama_model_quantize`` of the F16 file, its
default mix); before measuring, pyloader's dequantization of every block tensor must equal
ggml's reference bit for bit, and both engines' logits of one prompt on each file must be
correlated (:data:`GGUF_MIN_CORRELATION`; llama.cpp rounds activations to 8 bits).
Results go to ``llama-cpp-gguf-<shape>[-<level>].json``.

The memory bound is measured in the same run: a C program compiled on the fly sums a
``--bw-bytes`` buffer on ``--threads`` threads (best of 5) before each round; bound
tok/s = bandwidth / bytes of weights one decode step reads (every tensor, the embedding
table counting one row).

The load average (1 minute) is recorded before and after every measurement: llama.cpp's
threads spin, so another busy process changes its numbers more than pyloader's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from benchlib.paths import RAW
from benchlib.llamacpp_levels import (
    ENGINE_SCRIPT,
    level_python,
    machine_levels,
    python_has_llama,
    run_engine,
)
from benchlib.llamacpp_weights import (  # noqa: F401 - also the suite's names (tests)
    FORMATS,
    SHAPES,
    build_models,
    mlx_weight_bytes_per_token,
    n_params,
    shape_config,
    shape_names,
    tensor_values,
)
from pyloader.io import pagecache

RESULTS = RAW
PYTHON_ENV = "PYLOADER_LLAMA_CPP_PYTHON"

#: Shapes whose MLX-ops runs are measured (above this, one token takes minutes).
MLX_OPS_MAX_PARAMS = 1.2e9

ENGINES = ("llama.cpp", "pyloader", "mlx")
#: With ``--gguf``: llama.cpp and pyloader on the same GGUF file.
GGUF_ENGINES = ("llama.cpp", "pyloader-gguf")
ENGINE_LABELS = {"llama.cpp": "llama.cpp", "pyloader": "mlx-lm + pyloader kernels",
                 "mlx": "mlx-lm, MLX's ops",
                 "pyloader-gguf": "pyloader, the GGUF file in place"}
#: Largest max |logit difference| / max |logit| between the engines' F16 logits (both
#: round activations to 16 bits; a wrong weight layout gives differences of order 1).
LOGITS_TOLERANCE = 0.05
#: On one GGUF file, the smallest correlation of llama.cpp's logits with pyloader's (in
#: place, float32 activations). llama.cpp rounds activations to 8 bits for its quantized
#: products, which moves the logits of this random-weights 22-layer shape by up to ~20% of
#: the largest (0.98 correlated at Q4_0); a wrong weight layout gives no correlation.
GGUF_MIN_CORRELATION = 0.95
#: The max difference allowed on the built-in model (real weights, 30 layers).
GGUF_LOGITS_TOLERANCE = 0.1
#: Prompt of the decode runs (tokens before the first timed step).
CONTEXT = 16


# --- the llama.cpp Python -------------------------------------------------------------

def llama_python(explicit: str | None = None) -> str | None:
    """The Python that runs llama.cpp: ``explicit``, else ``$PYLOADER_LLAMA_CPP_PYTHON``,
    else ``python`` on PATH when ``import llama_cpp`` works there; None otherwise."""
    candidate = explicit or os.environ.get(PYTHON_ENV) or shutil.which("python")
    return candidate if candidate and python_has_llama(candidate) else None


# --- measuring ------------------------------------------------------------------------

_READ_BW_C = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef struct { const uint64_t *p; size_t n; uint64_t sum; } job_t;
static void *sum(void *arg) {
  job_t *j = arg; uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i + 4 <= j->n; i += 4) {
    s0 += j->p[i]; s1 += j->p[i + 1]; s2 += j->p[i + 2]; s3 += j->p[i + 3];
  }
  j->sum = s0 + s1 + s2 + s3; return NULL;
}
static double now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(int argc, char **argv) {
  size_t bytes = strtoull(argv[1], 0, 10); int threads = atoi(argv[2]), reps = atoi(argv[3]);
  size_t n = bytes / 8 / threads / 4 * 4 * threads;
  uint64_t *p = aligned_alloc(4096, n * 8);
  if (!p) { fprintf(stderr, "cannot allocate %zu bytes\n", n * 8); return 1; }
  memset(p, 1, n * 8);
  double best = 1e30; uint64_t check = 0;
  pthread_t tid[256]; job_t job[256];
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    for (int t = 0; t < threads; t++) {
      job[t].p = p + n / threads * t; job[t].n = n / threads;
      pthread_create(&tid[t], NULL, sum, &job[t]);
    }
    for (int t = 0; t < threads; t++) { pthread_join(tid[t], NULL); check += job[t].sum; }
    double dt = now() - t0; if (dt < best) best = dt;
  }
  printf("%.6f %llu\n", n * 8 / best / 1e9, (unsigned long long)check);
  return 0;
}
"""


def read_bandwidth(nbytes: int, threads: int, reps: int = 5) -> float:
    """GB/s of ``threads`` threads summing ``nbytes`` of memory (best of ``reps``)."""
    from pyloader.compare.system import cache_dir

    if not 1 <= threads <= 256:
        raise ValueError(f"threads must be 1..256, got {threads}")
    tag = f"{zlib.crc32(_READ_BW_C.encode()):08x}"
    exe = cache_dir("llama-cpp-bench") / f"read_bw-{tag}"
    if not exe.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            raise RuntimeError("no C compiler (cc, gcc or $CC) to build the bandwidth probe")
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "read_bw.c"
            src.write_text(_READ_BW_C)
            tmp = Path(d) / "read_bw"
            subprocess.run([cc, "-O3", "-march=native", "-pthread", "-o", str(tmp), str(src)],
                           check=True)
            shutil.move(str(tmp), exe)
    out = subprocess.run([str(exe), str(nbytes), str(threads), str(reps)], check=True,
                         capture_output=True, text=True).stdout.split()
    return float(out[0])


def prompt_tokens(vocab: int, n: int, seed: int) -> list[int]:
    """``n`` token ids past the byte and special tokens, fixed by ``seed``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return [int(t) for t in rng.integers(300, vocab, n)]


def peak_rss() -> int:
    """This process's peak resident set in bytes, as the engine script measures it
    (``VmHWM``: Linux's ``ru_maxrss`` carries the parent's peak across fork and exec)."""
    from pyloader.compare import system

    return system.peak_rss()


class _LastPosition:
    """An output head applied to the last position only."""

    def __init__(self, head):
        self.head = head

    def __call__(self, h):
        return self.head(h[:, -1:])


def mlx_measure(path: Path, kernels: str, tokens: list[int], *, prefill: int, decode: int,
                context: int, warmup: int, logits: Path | None) -> dict:
    """mlx-lm's model from ``pyloader.load_model``: the same protocol as
    bench/benchlib/llamacpp_engine.py's ``measure``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from pyloader.loading import load_model

    model, _ = load_model(path, kernels=kernels, tokenizer=False)
    # The last position's logits only, as llama.cpp computes them for a batch; the
    # model's own __call__ still runs (the kernels' attention is dispatched from it).
    model.lm_head = _LastPosition(model.lm_head)

    def run(cache, toks):
        y = model(mx.array(toks)[None], cache=cache)[0, -1]
        mx.eval(y)
        return y

    if warmup:
        cache = make_prompt_cache(model)
        run(cache, [run(cache, tokens[:warmup]).argmax().item()])
    t0 = time.perf_counter()
    last = run(make_prompt_cache(model), tokens[:prefill])
    out = {"prefill_s": time.perf_counter() - t0}
    if logits is not None:
        np.save(logits, np.array(last.astype(mx.float32)))
    cache = make_prompt_cache(model)
    y = run(cache, tokens[:context])
    greedy = []
    t0 = time.perf_counter()
    for _ in range(decode):
        tok = y.argmax().item()
        greedy.append(tok)
        y = run(cache, [tok])
    out["decode_s"] = time.perf_counter() - t0
    out["greedy"] = greedy
    out["peak_rss"] = peak_rss()
    return out


def _child_env(threads: int, level: str | None = None) -> dict:
    env = dict(os.environ, PYLOADER_KERNEL_THREADS=str(threads))
    if level:
        env["PYLOADER_KERNEL_ISA"] = level
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def measure_once(engine: str, fmt: str, root: Path, tokens: list[int], *, python: str,
                 threads: int, prefill: int, decode: int, warmup: int = 8,
                 logits: Path | None = None, level: str | None = None) -> dict:
    """One measurement of ``engine`` on ``fmt`` in a fresh process: its raw numbers
    (pyloader's kernels forced to ``level`` when given)."""
    _, stem, mlx_dir, _ = FORMATS[fmt]
    common = ["--prefill", str(prefill), "--decode", str(decode), "--context", str(CONTEXT),
              "--warmup", str(warmup), "--tokens", ",".join(map(str, tokens[:prefill]))]
    if logits is not None:
        common += ["--logits", str(logits)]
    if engine == "llama.cpp":
        files = [root / f"{stem}.gguf"]
        cmd = [python, str(ENGINE_SCRIPT), "measure", str(files[0]),
               "--threads", str(threads), *common]
    elif engine == "pyloader-gguf":
        files = [root / f"{stem}.gguf"]
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(files[0]),
               "--kernels", "auto", *common]
    else:
        files = sorted((root / mlx_dir).glob("*.safetensors"))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(root / mlx_dir),
               "--kernels", "auto" if engine == "pyloader" else "mlx", *common]
    # Pages cached just now: how long a file's pages had lived in the page cache
    # changed how fast they read on this project's VM.
    pagecache.recache(files)
    before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(threads, level))
    wall = time.perf_counter() - t0
    after = os.getloadavg()[0]
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} on {fmt} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    raw = {"prefill_tokens": prefill, "decode_tokens": decode,
           "prefill_tps": prefill / r["prefill_s"],
           "decode_tps": decode / r["decode_s"] if decode else None,
           "peak_rss": r["peak_rss"], "load_before": before, "load_after": after,
           "wall_s": round(wall, 2)}
    if engine == "llama.cpp":
        raw["weight_bytes_per_token"] = r["weight_bytes_per_token"]
        raw["buffers"] = r["buffers"]
    elif engine == "pyloader-gguf":
        raw["weight_bytes_per_token"] = gguf_weight_bytes_per_token(files[0])
    else:
        raw["weight_bytes_per_token"] = mlx_weight_bytes_per_token(root / mlx_dir)
    return raw


def gguf_weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads from a GGUF file: every tensor, the
    embedding table counting one row."""
    from pyloader.io.gguf_header import read_header

    total = 0
    for t in read_header(path).tensors.values():
        total += t.nbytes // t.shape[0] if t.name == "token_embd.weight" else t.nbytes
    return total


def check_dequantized(root: Path, formats: list[str], rows: int = 64) -> dict:
    """Each block tensor of each GGUF file (its first ``rows`` rows) dequantized by
    pyloader's kernels against gguf-py's reference dequantization (ggml's): bit for bit,
    else RuntimeError."""
    import gguf
    import mlx.core as mx

    from pyloader.cpu_kernels import ggml_dequantize
    from pyloader.io.gguf_header import read_header

    out = {}
    for fmt in formats:
        path = root / f"{FORMATS[fmt][1]}.gguf"
        data = np.memmap(path, dtype=np.uint8, mode="r")
        checked = 0
        for t in read_header(path).tensors.values():
            if len(t.shape) != 2 or t.type_name in ("F32", "F16", "BF16"):
                continue
            n = min(rows, t.shape[0])
            row_bytes = t.nbytes // t.shape[0]
            blocks = np.array(data[t.offset:t.offset + row_bytes * n]).reshape(n, -1)
            got = np.array(ggml_dequantize(mx.array(blocks), t.type_name, t.shape[1]))
            want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[t.type_name])
            if not np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)):
                raise RuntimeError(f"{path}: {t.name} ({t.type_name}): pyloader's "
                                   "dequantization differs from ggml's reference")
            checked += 1
        out[fmt] = checked
    return out


def check_gguf_logits(root: Path, formats: list[str], tokens: list[int], python: str,
                      threads: int) -> dict:
    """llama.cpp's and pyloader's logits of one prompt on each GGUF file (pyloader in
    place); RuntimeError below :data:`GGUF_MIN_CORRELATION`."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for fmt in formats:
            files = {e: Path(d) / f"{fmt}-{e}.npy" for e in GGUF_ENGINES}
            for engine, f in files.items():
                measure_once(engine, fmt, root, tokens, python=python, threads=threads,
                             prefill=CONTEXT, decode=0, warmup=0, logits=f)
            out[fmt] = compare_logits(np.load(files["llama.cpp"]),
                                      np.load(files["pyloader-gguf"]))
            if not out[fmt]["correlation"] >= GGUF_MIN_CORRELATION:
                raise RuntimeError(f"{fmt}: llama.cpp's and pyloader's logits on the same "
                                   f"GGUF file differ: {out[fmt]}")
    return out


def compare_logits(a: np.ndarray, b: np.ndarray) -> dict:
    """How far two logit vectors are apart."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits of shapes {a.shape} and {b.shape}")
    scale = float(np.max(np.abs(a))) or 1.0
    return {"max_abs_diff": float(np.max(np.abs(a - b))),
            "rel_diff": float(np.max(np.abs(a - b)) / scale),
            "correlation": float(np.corrcoef(a, b)[0, 1]),
            "same_argmax": bool(np.argmax(a) == np.argmax(b))}


def check_same_weights(root: Path, tokens: list[int], python: str, threads: int,
                       fmt: str = "f16", tolerance: float = LOGITS_TOLERANCE) -> dict:
    """Both engines' logits of one prompt on ``fmt``; RuntimeError when they differ by
    more than ``tolerance`` (relative to the largest logit)."""
    with tempfile.TemporaryDirectory() as d:
        files = {e: Path(d) / f"{e}.npy" for e in ("llama.cpp", "pyloader")}
        for engine, f in files.items():
            measure_once(engine, fmt, root, tokens, python=python, threads=threads,
                         prefill=CONTEXT, decode=0, warmup=0, logits=f)
        result = compare_logits(np.load(files["llama.cpp"]), np.load(files["pyloader"]))
    result.update(format=fmt, tolerance=tolerance)
    if not result["rel_diff"] <= tolerance:
        raise RuntimeError(f"llama.cpp's and mlx-lm's {fmt} logits differ: {result}; "
                           "the two files do not hold the same weights")
    return result


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(raw: dict[tuple[str, str], list[dict]], bandwidths: list[float]) -> list[dict]:
    """One row per (format, engine): medians, the bound, the fractions."""
    bw = statistics.median(bandwidths)
    rows = []
    for (fmt, engine), runs in raw.items():
        wbytes = runs[0]["weight_bytes_per_token"]
        row = {"format": fmt, "engine": engine,
               "weights": FORMATS[fmt][0 if engine in GGUF_ENGINES else 3],
               "weight_bytes_per_token": wbytes,
               "decode_tps": _median(r["decode_tps"] for r in runs),
               "prefill_tps": _median(r["prefill_tps"] for r in runs),
               "peak_rss": _median(r["peak_rss"] for r in runs),
               "bound_tps": bw * 1e9 / wbytes,
               "runs": runs}
        row["of_bound"] = row["decode_tps"] / row["bound_tps"] if row["decode_tps"] else None
        rows.append(row)
    ref = {r["format"]: r for r in rows if r["engine"] == "llama.cpp"}
    for r in rows:
        base = ref.get(r["format"])
        for k in ("decode", "prefill"):
            r[f"{k}_vs_llama_cpp"] = base and paired_ratio(r["runs"], base["runs"], f"{k}_tps")
    return rows


def paired_ratio(runs: list[dict], base: list[dict], key: str) -> float | None:
    """The median over rounds of ``runs[i][key] / base[i][key]``: each engine against
    llama.cpp measured in the same round (this host's memory bandwidth drifts by a third
    within minutes, so the medians of each engine alone would compare different moments)."""
    return _median(a[key] / b[key] if a.get(key) and b.get(key) else None
                   for a, b in zip(runs, base))


def machine_info(python: str, level: str | None = None) -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "platform": platform.platform()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    import mlx.core as mx
    import mlx_lm

    import pyloader.kernels

    info["mlx"], info["mlx_lm"] = mx.__version__, mlx_lm.__version__
    info["pyloader_kernels"] = level or pyloader.kernels.info()["isa"]
    llama = run_engine(python, "info")
    info["llama_cpp_python"] = llama["llama_cpp_python"]
    info["llama_cpp_system_info"] = llama["system_info"]
    return info


def run(args) -> list[dict]:
    """The measurements: one result per level (a single one, at pyloader's own choice of
    level against the given llama.cpp, without ``--levels``)."""
    loadavg_start = os.getloadavg()
    formats = (args.formats.split(",") if args.formats else
               [f for f in FORMATS if args.gguf or FORMATS[f][2] is not None])
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"--formats: unknown {bad}; expected some of {', '.join(FORMATS)}")
    if args.levels:
        pythons = {lv: level_python(lv) for lv in machine_levels(args.levels)}
    else:
        python = llama_python(args.llama_python)
        if python is None:
            raise SystemExit(f"no Python with llama_cpp and gguf: set {PYTHON_ENV} (or "
                             "--llama-python) to one, or measure --levels")
        pythons = {None: python}
    python = next(iter(pythons.values()))
    config = shape_config(args.shape)
    engines = [e for e in ENGINES if e != "mlx" or
               (not args.no_mlx_ops and n_params(config) <= MLX_OPS_MAX_PARAMS)]
    if args.gguf:
        engines = list(GGUF_ENGINES)
    elif any(FORMATS[f][2] is None for f in formats):
        raise SystemExit("--formats: the K-quant formats have no mlx-lm directory: "
                         "measure them with --gguf (the GGUF file in place)")
    print(f"[{args.shape}] models", flush=True)
    root = build_models(args.shape, formats, python, seed=args.seed)
    tokens = prompt_tokens(config["vocab_size"], max(args.prefill, CONTEXT), args.seed)
    print(f"[{args.shape}] same weights? F16 logits of both engines", flush=True)
    check = check_same_weights(root, tokens, python, args.threads)
    print(f"  rel diff {check['rel_diff']:.2e}, correlation {check['correlation']:.6f}",
          flush=True)
    gguf_check = None
    if args.gguf:
        print(f"[{args.shape}] logits on each GGUF file, llama.cpp vs in place", flush=True)
        dequantized = check_dequantized(root, formats)
        print(f"  dequantized bit for bit as ggml: {dequantized} block tensors", flush=True)
        gguf_check = check_gguf_logits(root, formats, tokens, python, args.threads)
        for fmt, c in gguf_check.items():
            print(f"  {fmt}: rel diff {c['rel_diff']:.2e}, correlation "
                  f"{c['correlation']:.4f}, same argmax {c['same_argmax']}", flush=True)
        gguf_check["dequantized_tensors"] = dequantized
    raw: dict[tuple, list[dict]] = {
        (lv, f, e): [] for lv in pythons for f in formats for e in engines
        if e != "mlx" or args.mlx_runs > 0}
    bandwidths = []
    for i in range(args.runs):
        bandwidths.append(read_bandwidth(args.bw_bytes, args.threads))
        print(f"[{args.shape}] run {i + 1}/{args.runs}: read bandwidth "
              f"{bandwidths[-1]:.1f} GB/s", flush=True)
        for level, lpython in pythons.items():
            for fmt in formats:
                for engine in engines:
                    capped = engine == "mlx"
                    if capped and i >= args.mlx_runs:
                        continue
                    r = measure_once(engine, fmt, root, tokens, python=lpython,
                                     threads=args.threads,
                                     prefill=args.mlx_prefill if capped else args.prefill,
                                     decode=args.mlx_decode if capped else args.decode,
                                     warmup=0 if capped else 8, level=level)
                    raw[(level, fmt, engine)].append(r)
                    print(f"  {level or '':6} {fmt:4} {engine:9} decode "
                          f"{r['decode_tps']:8.3f} tok/s  prefill {r['prefill_tps']:8.2f} "
                          f"tok/s  rss {r['peak_rss'] / 2**30:5.2f} GiB  load "
                          f"{r['load_before']:.2f}->{r['load_after']:.2f}  "
                          f"({r['wall_s']:.0f} s)", flush=True)
    common = {"shape": args.shape, "config": config, "seed": args.seed,
              "threads": args.threads, "runs": args.runs, "prefill_tokens": args.prefill,
              "decode_tokens": args.decode,
              "mlx_ops_tokens": {"prefill": args.mlx_prefill, "decode": args.mlx_decode,
                                 "runs": min(args.mlx_runs, args.runs)},
              "context_tokens": CONTEXT, "bw_bytes": args.bw_bytes,
              "bandwidth_gbs": {"median": statistics.median(bandwidths), "runs": bandwidths},
              "logits_check": check, "gguf_logits_check": gguf_check,
              "date": time.strftime("%Y-%m-%d"),
              "loadavg_start": loadavg_start}
    results = []
    for level, lpython in pythons.items():
        mine = {(f, e): runs for (lv, f, e), runs in raw.items() if lv == level}
        results.append(dict(common, level=level, machine=machine_info(lpython, level),
                            results=summarise(mine, bandwidths)))
    return results


# --- the report -----------------------------------------------------------------------

def _num(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _llama_flags(machine: dict) -> str:
    """The instruction sets llama.cpp reports it was built with."""
    info = machine.get("llama_cpp_system_info", "")
    return " ".join(part.split("=")[0].strip() for part in info.replace("CPU :", "").split("|")
                    if part.strip().endswith("= 1") and "REPACK" not in part
                    and "LLAMAFILE" not in part and "OPENMP" not in part)


def _gguf_check(result: dict) -> str:
    checks = result.get("gguf_logits_check")
    if not checks:
        return ""
    rows = [c for k, c in checks.items() if k != "dequantized_tensors"]
    return (f" Same file: llama.cpp's logits within {max(c['rel_diff'] for c in rows):.2f} "
            f"of the largest, correlation ≥ {min(c['correlation'] for c in rows):.3f} "
            "(llama.cpp rounds activations to 8 bits); every block tensor dequantized as "
            "ggml's reference, bit for bit.")


def report_table(result: dict) -> str:
    """Markdown for one results file."""
    loads = [v for row in result["results"] for r in row["runs"]
             for v in (r["load_before"], r["load_after"])]
    m, mo = result["machine"], result["mlx_ops_tokens"]
    with_mlx = any(r["engine"] == "mlx" for r in result["results"])
    level = result.get("level")
    level_label = (f", level `{level}`: pyloader forced to it, llama.cpp built for it "
                   f"({_llama_flags(m)})" if level else "")
    mlx_ops = (f" (MLX's ops: {mo['decode']} and {mo['prefill']}, "
               f"{mo.get('runs', result['runs'])} run(s))" if with_mlx else "")
    lines = [
        f"**{result['shape']}**{level_label} ({n_params(result['config']) / 1e9:.2f}e9 "
        "parameters), "
        f"{m['cpu']}, {result['threads']} threads, medians of {result['runs']} interleaved "
        f"runs, {result['date']}. Read bandwidth {result['bandwidth_gbs']['median']:.1f} GB/s; "
        f"load average {min(loads):.2f}–{max(loads):.2f}. Decode: "
        f"{result['decode_tokens']} greedy tokens after {result['context_tokens']}; prefill: "
        f"{result['prefill_tokens']} tokens{mlx_ops}. "
        f"Same weights: F16 logits within {result['logits_check']['rel_diff']:.1e} of the "
        f"largest.{_gguf_check(result)} mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, "
        f"pyloader kernels {m['pyloader_kernels']}, "
        f"llama-cpp-python {m['llama_cpp_python']}.",
        "",
        "| weights | engine | decode tok/s | ÷ llama.cpp | of bound | prefill tok/s "
        "| ÷ llama.cpp | peak RSS GiB | bound tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['weights']} | {ENGINE_LABELS[r['engine']]} | {_num(r['decode_tps'])} | "
            f"{_num(r['decode_vs_llama_cpp'], '{:.3g}×')} | {_num(r['of_bound'], '{:.0%}')} | "
            f"{_num(r['prefill_tps'])} | {_num(r['prefill_vs_llama_cpp'], '{:.3g}×')} | "
            f"{r['peak_rss'] / 2**30:.2f} | {_num(r['bound_tps'], '{:.1f}')} |")
    return "\n".join(lines)


def results_path(shape: str, out_dir: Path = RESULTS, level: str | None = None,
                 gguf: bool = False) -> Path:
    kind = "llama-cpp-gguf" if gguf else "llama-cpp"
    return out_dir / f"{kind}-{shape}{'-' + level if level else ''}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tinyllama-1.1b",
                    help="tinyllama-1.1b, llama3.1-8b, or llama3.1-8b-tiny (tests)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--formats", default=None,
                    help="comma-separated (default: every format the engines read: with "
                         "--gguf the K-quant mixes too)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--mlx-prefill", type=int, default=2,
                    help="prefill tokens of the kernels='mlx' runs")
    ap.add_argument("--mlx-decode", type=int, default=1,
                    help="decode tokens of the kernels='mlx' runs")
    ap.add_argument("--mlx-runs", type=int, default=1,
                    help="rounds that include the kernels='mlx' runs (the first ones)")
    ap.add_argument("--no-mlx-ops", action="store_true", help="skip the kernels='mlx' runs")
    ap.add_argument("--gguf", action="store_true",
                    help="llama.cpp and pyloader on the same GGUF files (pyloader reads them "
                         "in place); the formats may include q4_k_m, q5_k_m, q6_k")
    ap.add_argument("--bw-bytes", type=int, default=2 << 30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-python", help=f"default: ${PYTHON_ENV}, else python on PATH")
    ap.add_argument("--levels", help="all, or some of avx2,avx512,amx: each level forced "
                    "against llama.cpp built for it (in cached environments)")
    ap.add_argument("--out", type=Path, help="results JSON (default: "
                    "bench/results/raw/llama-cpp-<shape>.json)")
    ap.add_argument("--report", action="store_true",
                    help="print the table of every llama-cpp-*.json in --results and exit")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where --report reads (default bench/results/raw)")
    # the MLX child (one measurement in this process)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--kernels", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=CONTEXT, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--logits", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        tokens = [int(t) for t in args.tokens.split(",")]
        r = mlx_measure(args.child, args.kernels, tokens, prefill=args.prefill,
                        decode=args.decode, context=args.context, warmup=args.warmup,
                        logits=args.logits)
        print(json.dumps(r))
        return 0
    if args.report:
        files = sorted(args.results.glob("llama-cpp-*.json"))
        if not files:
            print(f"no llama-cpp-*.json in {args.results}: run the benchmark first",
                  file=sys.stderr)
            return 1
        print("\n\n".join(report_table(json.loads(f.read_text())) for f in files))
        return 0
    if args.out and args.levels:
        raise SystemExit("--out names one file; --levels writes one per level "
                         "(use --results for the directory)")
    given = list(sys.argv[1:] if argv is None else argv)
    if "--out" in given:  # where the raw file went is not part of how it was measured
        del given[given.index("--out"):given.index("--out") + 2]
    command = " ".join(["python bench/llama_cpp.py",
                        *(a for a in given if not a.startswith("--out="))])
    for result in run(args):
        result["command"] = command
        out = args.out or results_path(args.shape, args.results, result["level"], args.gguf)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
