"""GGUF files quantized by llama.cpp itself, every architecture read in place
(``pytest -m llamacpp tests/test_gguf_llamacpp.py``; out of the default run: it builds
llama-cpp-python from PyPI once, minutes, into the cache bench/llama_cpp.py uses).

Each architecture's tiny random model is written in F16 (llama.cpp's gguf-py), then
``llama_model_quantize`` makes each of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (every matrix) and
the Q2_K, Q3_K_M, Q4_K_M, Q5_K_M and Q6_K mixes.
On every file: each block tensor dequantized by pyloader's kernels equals gguf-py's
reference dequantization (ggml's) bit for bit; ``load_model`` in place gives llama.cpp's
logits of a prompt on the same file within its activation rounding (llama.cpp rounds
activations to 8 bits for its quantized products); ``convert_gguf`` writes a directory
mlx-lm loads."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf_inplace_files import write_model

import pyloader
from pyloader.cpu_kernels import ggml_dequantize
from pyloader.gguf import convert_gguf
from pyloader.io.gguf_header import read_header

pytestmark = pytest.mark.llamacpp

gguf = pytest.importorskip("gguf", reason="the test extra's gguf (llama.cpp's gguf-py)")

#: (GGUF architecture, write_model options) of each architecture read in place.
ARCHITECTURES = {
    "llama": {},
    "qwen2": {"tied": True},
    "qwen3": {},
    "phi3": {"rope_dim": 32},
    "gemma2": {"tied": True},
    "gemma3": {"tied": True, "sizes": {"n_layer": 6}},
    "qwen3moe": {"experts": True},
}
FTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k")
PROMPT = [(7 * i + 3) % 256 for i in range(12)]
#: Smallest correlation of pyloader's logits (float32 activations) with llama.cpp's (8-bit
#: activations in its quantized products): 0.994 to 1.000 measured; a wrong layout gives ~0.
MIN_CORRELATION = 0.99


@pytest.fixture(scope="module")
def llama_python() -> str:
    """The Python of an environment with llama-cpp-python (``$PYLOADER_LLAMA_CPP_PYTHON``,
    else built for the avx2 level into the cache)."""
    from benchlib.llamacpp_levels import level_python

    return os.environ.get("PYLOADER_LLAMA_CPP_PYTHON") or level_python("avx2")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Each architecture's model in F16, as llama.cpp's quantizer takes it."""
    root = tmp_path_factory.mktemp("f16")
    out = {}
    for arch, options in ARCHITECTURES.items():
        out[arch] = root / f"{arch}.gguf"
        write_model(out[arch], arch, "F16", embed="F16", seed=11, **options)
    return out


def _logits_of_llama_cpp(python: str, path: Path, tmp: Path) -> np.ndarray:
    from benchlib.llamacpp_levels import run_engine

    f = tmp / f"{path.stem}-logits.npy"
    csv = ",".join(map(str, PROMPT))
    run_engine(python, "measure", str(path), "--tokens", csv, "--prefill", str(len(PROMPT)),
               "--decode", "0", "--context", str(len(PROMPT)), "--warmup", "0",
               "--logits", str(f))
    return np.load(f).astype(np.float64)


@pytest.mark.parametrize("ftype", FTYPES)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_file_llama_cpp_quantized_reads_in_place(llama_python, sources, tmp_path, arch,
                                                    ftype):
    import mlx_lm
    from benchlib.llamacpp_levels import run_engine

    path = tmp_path / f"{arch}-{ftype}.gguf"
    run_engine(llama_python, "quantize", str(sources[arch]), str(path), "--ftype", ftype)

    data = np.memmap(path, dtype=np.uint8, mode="r")
    types = set()
    for t in read_header(path).tensors.values():
        if t.type_name in ("F32", "F16", "BF16"):
            continue
        types.add(t.type_name)
        blocks = np.array(data[t.offset:t.offset + t.nbytes]).reshape(-1, t.nbytes //
                                                                       int(np.prod(t.shape[:-1])))
        got = np.array(ggml_dequantize(mx.array(blocks), t.type_name, t.shape[-1]))
        want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[t.type_name])
        assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), \
            (t.name, t.type_name)
    assert types, "llama.cpp left every tensor in floating point"

    model, _ = pyloader.load_model(path, kernels="auto", tokenizer=False)
    ours = np.array(model(mx.array([PROMPT]))[0, -1].astype(mx.float32), dtype=np.float64)
    theirs = _logits_of_llama_cpp(llama_python, path, tmp_path)
    assert np.isfinite(ours).all() and ours.shape == theirs.shape
    correlation = float(np.corrcoef(ours, theirs)[0, 1])
    scale = np.abs(theirs).max()
    print(f"{arch} {ftype} {sorted(types)}: correlation {correlation:.4f}, largest difference "
          f"{np.abs(ours - theirs).max() / scale:.3f} of the largest logit")
    assert correlation >= MIN_CORRELATION, (sorted(types), correlation)

    out = convert_gguf(path, tmp_path / "converted")
    converted, _ = mlx_lm.load(str(out))
    assert np.isfinite(np.array(converted(mx.array([PROMPT])).astype(mx.float32))).all()
