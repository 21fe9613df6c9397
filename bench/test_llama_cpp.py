"""Fast checks of the llama.cpp suite's pure parts (bench/llama_cpp.py): the weights, the GGUF
files, the report.

    PYLOADER_LLAMA_CPP_PYTHON=/path/to/python pytest bench/test_llama_cpp.py

The tests that write or read GGUF run its llamacpp_engine.py in the Python that has
llama-cpp-python and gguf (``$PYLOADER_LLAMA_CPP_PYTHON``, else ``python`` on PATH when
it has them); without one they are skipped, saying so.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import llama_cpp as bench

ROOT = Path(__file__).resolve().parent.parent
from benchlib import llamacpp_engine as engine

# The engine runs by path in the llama.cpp Python, which need not have pyloader.
HERE = Path(engine.__file__).resolve().parent


@pytest.fixture(scope="module")
def llama_python():
    python = bench.llama_python()
    if python is None:
        reason = (f"no Python with llama_cpp and gguf (set {bench.PYTHON_ENV}): the GGUF "
                  "tests need llama-cpp-python")
        print(reason)
        pytest.skip(reason)
    return python


@pytest.fixture(scope="module")
def tiny(llama_python, tmp_path_factory):
    """The tiny shape in float16 (mlx-lm directory and GGUF), and a GGUF whose Q and K
    were not permuted."""
    root = bench.build_models("tiny", ["f16", "bf16"], llama_python,
                              root=tmp_path_factory.mktemp("tiny"), log=lambda *_: None)
    bench.run_engine(llama_python, "write-gguf", str(root / "mlx-f16"),
                  str(root / "unpermuted.gguf"), "--type", "f16", "--no-rope-permute")
    return root


def test_rope_permute_interleaves_each_heads_halves():
    # 2 heads of dim 4, 3 columns: row r holds r.
    w = np.repeat(np.arange(8, dtype=np.float32)[:, None], 3, axis=1)
    out = engine.rope_permute(w, 2)
    # llama.cpp pairs (2i, 2i+1) where Hugging Face pairs (i, i + d/2).
    assert out[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="heads of even size"):
        engine.rope_permute(w[:6], 2)


def test_tensor_values_are_exact_in_float16_and_bfloat16():
    chunks = list(bench.tensor_values("model.layers.0.mlp.up_proj.weight", (64, 300), 7))
    x = np.concatenate(chunks).astype(np.float32)
    assert x.size == 64 * 300 and x.std() > 0.01
    u = x.view(np.uint32)
    assert not np.any(u & np.uint32(0xFFFF)), "not bfloat16"
    assert np.all((x == 0) | (np.abs(x) >= 2.0**-14)), "float16 subnormal"
    again = np.concatenate(list(bench.tensor_values("model.layers.0.mlp.up_proj.weight",
                                                    (64, 300), 7)))
    other = np.concatenate(list(bench.tensor_values("model.layers.0.mlp.up_proj.weight",
                                                    (64, 300), 8)))
    assert np.array_equal(again, chunks[0]) and not np.array_equal(other, chunks[0])
    norm = np.concatenate(list(bench.tensor_values("model.norm.weight", (16,), 7)))
    assert norm.tolist() == [1.0] * 16


_COMPARE = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import llamacpp_engine as e
import gguf
src, path, kind = sys.argv[2], sys.argv[3], sys.argv[4]
config = json.load(open(src + "/config.json"))
st = e.read_safetensors(__import__("pathlib").Path(src) / "model.safetensors")
names = dict((g, h) for h, g in e.gguf_names(config["num_hidden_layers"]))
bad, seen = [], 0
for t in gguf.GGUFReader(path).tensors:
    a = np.asarray(st[names[t.name]], np.float32)
    if t.name.endswith("attn_q.weight"):
        a = e.rope_permute(a, config["num_attention_heads"])
    elif t.name.endswith("attn_k.weight"):
        a = e.rope_permute(a, config["num_key_value_heads"])
    data = np.asarray(t.data)
    if kind == "bf16" and a.ndim == 2:
        # (gguf reads BF16 as raw bytes: two uint8 per value)
        b = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        b = data.astype(np.float32)
    seen += 1
    if b.shape != a.shape or not np.array_equal(a, b):
        bad.append(t.name)
print(json.dumps({"seen": seen, "bad": bad}))
"""


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_gguf_holds_the_checkpoints_values(tiny, llama_python, kind):
    out = subprocess.run([llama_python, "-c", _COMPARE, str(HERE), str(tiny / "mlx-f16"),
                          str(tiny / f"{kind}.gguf"), kind],
                         capture_output=True, text=True, check=True, cwd="/")
    r = json.loads(out.stdout.splitlines()[-1])
    config = bench.SHAPES["tiny"]
    assert r == {"seen": 9 * config["num_hidden_layers"] + 3, "bad": []}


def test_both_engines_compute_the_same_logits(tiny, llama_python):
    tokens = bench.prompt_tokens(bench.SHAPES["tiny"]["vocab_size"], 32, 0)
    r = bench.check_same_weights(tiny, tokens, llama_python, threads=2)
    assert r["correlation"] > 0.9999 and r["same_argmax"]


def test_unpermuted_gguf_fails_the_check(tiny, llama_python):
    tokens = bench.prompt_tokens(bench.SHAPES["tiny"]["vocab_size"], 32, 0)
    bad = tiny / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "f16.gguf").unlink(missing_ok=True)
    (bad / "f16.gguf").symlink_to(tiny / "unpermuted.gguf")
    (bad / "mlx-f16").unlink(missing_ok=True)
    (bad / "mlx-f16").symlink_to(tiny / "mlx-f16")
    with pytest.raises(RuntimeError, match="do not hold the same weights"):
        bench.check_same_weights(bad, tokens, llama_python, threads=2)


def test_weight_bytes_per_token_counts_one_embedding_row(tiny, llama_python):
    c = bench.SHAPES["tiny"]
    n = bench.n_params(c)
    row = c["hidden_size"]
    assert bench.mlx_weight_bytes_per_token(tiny / "mlx-f16") == 2 * (n - c["vocab_size"] * row
                                                                     + row)
    out = subprocess.run(
        [llama_python, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
         "import llamacpp_engine as e; print(e.weight_bytes_per_token(sys.argv[2]))",
         str(HERE), str(tiny / "f16.gguf")], capture_output=True, text=True, check=True,
        cwd="/")
    norms = (2 * c["num_hidden_layers"] + 1) * row  # float32 in GGUF
    assert int(out.stdout) == 2 * (n - c["vocab_size"] * row + row) + 2 * norms


def _run(decode, prefill, rss=2**30, load=(0.5, 0.7), wbytes=10**9):
    return {"decode_tps": decode, "prefill_tps": prefill, "peak_rss": rss,
            "load_before": load[0], "load_after": load[1], "weight_bytes_per_token": wbytes,
            "prefill_tokens": 256, "decode_tokens": 64}


def _result():
    raw = {("q4", "llama.cpp"): [_run(20, 100), _run(30, 120), _run(25, 80)],
           ("q4", "pyloader"): [_run(10, 60), _run(15, 36, load=(0.2, 1.9)), _run(11, 50)],
           ("q4", "mlx"): [_run(0.01, 0.02)]}
    return {"shape": "tiny", "config": bench.SHAPES["tiny"], "threads": 2, "runs": 3,
            "date": "2025-01-01", "decode_tokens": 64, "prefill_tokens": 256,
            "context_tokens": 16, "mlx_ops_tokens": {"prefill": 4, "decode": 2},
            "bandwidth_gbs": {"median": 40.0, "runs": [30.0, 40.0, 50.0]},
            "logits_check": {"rel_diff": 1e-3},
            "machine": {"cpu": "Test CPU", "mlx": "m", "mlx_lm": "l", "pyloader_kernels": "k",
                        "llama_cpp_python": "p"},
            "results": bench.summarise(raw, [30.0, 40.0, 50.0])}


def test_summarise_takes_medians_and_ratios():
    """Each engine's medians; a ratio to llama.cpp is the median of the rounds' ratios
    (decode 10/20, 15/30, 11/25; prefill 60/100, 36/120, 50/80), not 11/25 and 50/100."""
    rows = {r["engine"]: r for r in _result()["results"]}
    assert rows["llama.cpp"]["decode_tps"] == 25 and rows["pyloader"]["decode_tps"] == 11
    assert rows["pyloader"]["decode_vs_llama_cpp"] == pytest.approx(0.5)
    assert rows["pyloader"]["prefill_vs_llama_cpp"] == pytest.approx(0.6)
    assert rows["pyloader"]["bound_tps"] == pytest.approx(40.0)  # 40 GB/s over 1 GB
    assert rows["llama.cpp"]["of_bound"] == pytest.approx(25 / 40)


def test_report_table_and_report_mode(tmp_path, capsys):
    result = _result()
    table = bench.report_table(result)
    lines = [ln for ln in table.splitlines() if ln.startswith(("| Q4_0", "| 4-bit"))]
    assert len(lines) == 3
    assert "| 4-bit g64, float16 scales | mlx-lm + pyloader kernels | 11.00 | 0.5× | 28% | " \
           "50.00 | 0.6× | 1.00 | 40.0 |" in lines
    assert "load average 0.20–1.90" in table and "40.0 GB/s" in table

    (tmp_path / "llama-cpp-x.json").write_text(json.dumps(result))
    assert bench.main(["--report", "--results", str(tmp_path)]) == 0
    assert table in capsys.readouterr().out
    assert bench.main(["--report", "--results", str(tmp_path / "none")]) == 1


@pytest.mark.parametrize("engine_name", ["llama.cpp", "pyloader"])
def test_peak_rss_is_the_childs_own(tiny, llama_python, engine_name):
    # Linux's ru_maxrss carries the parent's peak into a forked child: a parent holding
    # 1 GiB must not make every child report 1 GiB.
    ballast = np.ones(1 << 27)  # 1 GiB, touched
    tokens = bench.prompt_tokens(bench.SHAPES["tiny"]["vocab_size"], 32, 0)
    r = bench.measure_once(engine_name, "f16", tiny, tokens, python=llama_python, threads=2,
                           prefill=32, decode=2)
    assert ballast.sum() == 1 << 27
    assert 0 < r["peak_rss"] < 600 << 20
    assert r["decode_tps"] > 0 and r["prefill_tps"] > 0


def test_ggml_flags_build_one_level_only():
    from benchlib.llamacpp_levels import ggml_flags

    avx2 = ggml_flags("avx2", {"avx2", "avx512f", "avx512_vnni"})
    assert "-DGGML_NATIVE=OFF" in avx2
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_FMA=ON" in avx2 and "-DGGML_F16C=ON" in avx2
    assert "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX512_VNNI=OFF" in avx2
    assert "-DGGML_AMX_TILE=OFF" in avx2
    avx512 = ggml_flags("avx512", {"avx512_vnni"})
    assert "-DGGML_AVX512=ON" in avx512 and "-DGGML_AVX512_VNNI=ON" in avx512
    assert "-DGGML_AVX512_BF16=OFF" in avx512 and "-DGGML_AMX_INT8=OFF" in avx512
    assert "-DGGML_AMX_BF16=ON" in ggml_flags("amx", set())
    with pytest.raises(ValueError, match="baseline"):
        ggml_flags("baseline")


def test_report_names_the_level(tmp_path):
    result = _result()
    result["level"] = "avx2"
    result["machine"]["llama_cpp_system_info"] = "CPU : AVX = 1 | AVX2 = 1 | REPACK = 1 |"
    text = bench.report_table(result)
    assert "level `avx2`" in text and "(AVX AVX2)" in text
    assert bench.results_path("s", tmp_path, "avx2").name == "llama-cpp-s-avx2.json"


def test_default_gguf_in_place_against_llama_cpp(llama_python, tmp_path):
    """The built-in model's GGUF (a real SmolLM2 vocabulary and weights, Q4_1) read in
    place: llama.cpp's tokens for real text, and its logits within the GGUF tolerance with
    the same next token."""
    import json
    import subprocess

    import mlx.core as mx

    import pyloader
    from pyloader.default_model import DefaultModelMissing, default_gguf_path

    try:
        gguf = default_gguf_path()
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    text = (ROOT / "README.md").read_text() + "\nÜber naïve café — 東京 3.14159 ✓\n"
    (tmp_path / "text.txt").write_text(text)
    script = ("import json, sys, llama_cpp\n"
              "llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
              "print(json.dumps(llm.tokenize(open(sys.argv[2]).read().encode(), "
              "add_bos=False, special=False)))\n")
    out = subprocess.run([llama_python, "-c", script, str(gguf), str(tmp_path / "text.txt")],
                         capture_output=True, text=True, check=True)
    model, tok = pyloader.load_model(gguf, kernels="auto")
    assert tok.encode(text, add_special_tokens=False) == json.loads(out.stdout)
    prompt = tok.encode("The capital of France is")
    logits = tmp_path / "llama.npy"
    bench.run_engine(llama_python, "measure", str(gguf), "--tokens",
                     ",".join(map(str, prompt)), "--prefill", str(len(prompt)), "--decode",
                     "0", "--context", str(len(prompt)), "--warmup", "0", "--logits",
                     str(logits))
    mine = np.array(model(mx.array([prompt]))[0, -1].astype(mx.float32))
    c = bench.compare_logits(np.load(logits), mine)
    assert c["same_argmax"] and c["rel_diff"] <= bench.GGUF_LOGITS_TOLERANCE, c
    assert c["correlation"] >= bench.GGUF_MIN_CORRELATION, c
