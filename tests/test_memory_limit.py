"""The memory-limit proof: a model larger than a memory cgroup's limit runs
by streaming, where plain mlx-lm loading fails.

Skipped, with the reason printed, where memory cgroups cannot be created
(non-root, cgroup v2 only, containers)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from cgroup import PYTHON, MemoryCgroup, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"memory cgroup: {REASON}")

LIMIT = 600 * 10**6
N_TOKENS = 6

# A llama of ~1.5 GB in bf16: 14 layers of ~103 MB, small vocabulary.
BUILD = "import sys; from benchlib.synthetic import make_model; make_model(sys.argv[1], 1_600_000_000)"
#: The builders' environment: the source tree's bench/ (benchlib) on the path.
BENCH_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "bench")}

GENERATE = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "mlx-lm":
        from pathlib import Path
        from mlx_lm.utils import load_model
        model, _ = load_model(Path(path))
    else:
        import pyloader
        # "pread-all": resident=1.0; "pread-300MB": that budget; "pread": resident=0
        strategy, _, res = mode.partition("-")
        model, _ = pyloader.load_model(
            path, resident=1.0 if res == "all" else res or 0,
            options=pyloader.StreamOptions(strategy=strategy, prefetch=1))
    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8])
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]
    print(json.dumps({"tokens": tokens}))
""")


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    import subprocess
    path = tmp_path_factory.mktemp("big")
    subprocess.run([PYTHON, "-c", BUILD, str(path)], check=True, cwd=path, env=BENCH_ENV)
    size = (path / "model.safetensors").stat().st_size
    assert size > 2.4 * LIMIT, size
    return path


@pytest.fixture(scope="module")
def reference_tokens(big_model):
    """Plain mlx-lm's tokens on big_model, without a limit."""
    import subprocess

    free = subprocess.run([PYTHON, "-c", GENERATE, "mlx-lm", str(big_model), str(N_TOKENS)],
                          capture_output=True, text=True, cwd=big_model, timeout=600)
    assert free.returncode == 0, free.stderr
    return json.loads(free.stdout)["tokens"]


def run(cg, mode, path):
    out = cg.run([PYTHON, "-c", GENERATE, mode, str(path), str(N_TOKENS)], timeout=600,
                 cwd=str(path))
    return out


def test_streaming_runs_a_model_larger_than_the_limit(big_model, reference_tokens):
    with MemoryCgroup(LIMIT) as cg:
        plain = run(cg, "mlx-lm", big_model)
        assert plain.returncode != 0, "plain mlx-lm fitted under the limit: the proof is void"
        print(f"plain mlx-lm under {LIMIT} bytes: exit {plain.returncode}")

    for strategy in ("mmap", "pread"):
        with MemoryCgroup(LIMIT) as cg:
            streamed = run(cg, strategy, big_model)
            assert streamed.returncode == 0, streamed.stderr[-2000:]
            assert json.loads(streamed.stdout)["tokens"] == reference_tokens
            peak = cg.read("memory.max_usage_in_bytes")
            print(f"streaming ({strategy}) peak cgroup usage {peak} of limit {LIMIT}")
            # Never even touched the limit: no reclaim was needed to fit.
            assert peak < LIMIT
            assert cg.read("memory.failcnt") == 0


def test_a_load_that_cannot_fit_is_a_memory_error_not_a_kill(big_model, reference_tokens):
    """pread with every layer resident needs the whole model in anonymous memory: the
    pre-flight refuses it before reading anything, naming a setting that fits; the
    cgroup's limit is never reached."""
    with MemoryCgroup(LIMIT) as cg:
        out = run(cg, "pread-all", big_model)
        assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
        err = out.stderr
        assert "MemoryError" in err and str(big_model) in err and "nothing was loaded" in err
        assert "memory cgroup" in err and "strategy='mmap'" in err, err[-2000:]
        assert "resident='" in err, err[-2000:]
        assert cg.read("memory.failcnt") == 0
        print(err.strip().splitlines()[-1])
    # The suggested budget really fits: it runs in the same limit, with mlx-lm's tokens.
    budget = err.split("resident='")[1].split("'")[0]
    with MemoryCgroup(LIMIT) as cg:
        fits = run(cg, f"pread-{budget}", big_model)
        assert fits.returncode == 0, (fits.returncode, fits.stderr[-2000:])
    assert json.loads(fits.stdout)["tokens"] == reference_tokens


# ----------------------------------------------------------------------------
# A mixture-of-experts model larger than the limit, by expert streaming

MOE_LIMIT = 500 * 10**6
MOE_BUILD = ("import sys; from benchlib.synthetic import make_moe_model; "
             "make_moe_model(sys.argv[1], 1_000_000_000)")
MOE_GENERATE = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    vocab = int(sys.argv[4]) if len(sys.argv) > 4 else 8192
    if mode == "mlx-lm":
        from pathlib import Path
        from mlx_lm.utils import load_model
        model, _ = load_model(Path(path))
    else:  # "all": pyloader, every expert resident; else that fraction of them cached
        import pyloader
        model, _ = pyloader.load_model(path, options=pyloader.StreamOptions(
            experts="layer" if mode == "all" else float(mode)))
    prompt = mx.array([(7 * i + 1) % vocab for i in range(24)])
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]
    out = {"tokens": tokens}
    if mode not in ("mlx-lm", "all"):
        out["experts"] = pyloader.stats(model)["experts"]["total"]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def big_moe(tmp_path_factory):
    import subprocess
    path = tmp_path_factory.mktemp("big-moe")
    subprocess.run([PYTHON, "-c", MOE_BUILD, str(path)], check=True, cwd=path,
                   capture_output=True, env=BENCH_ENV)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert size > 1.8 * MOE_LIMIT, size
    return path


def _experts_stream_under_the_limit(path, reference: str, *extra: str, cwd=None, env=None):
    """A free ``reference`` run of MOE_GENERATE, then one with an expert cache of 12.5% of
    each layer's experts under MOE_LIMIT: the same tokens, the limit never reached, experts
    really streamed. Returns the streamed run's expert stats and the cgroup's peak."""
    import subprocess

    args = [str(path), str(N_TOKENS), *extra]
    free = subprocess.run([PYTHON, "-c", MOE_GENERATE, reference, *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd, env=env)
    assert free.returncode == 0, free.stderr[-2000:]
    with MemoryCgroup(MOE_LIMIT) as cg:
        streamed = cg.run([PYTHON, "-c", MOE_GENERATE, "0.125", *args], timeout=600, cwd=cwd,
                          env=env)
        assert streamed.returncode == 0, streamed.stderr[-2000:]
        out = json.loads(streamed.stdout)
        assert out["tokens"] == json.loads(free.stdout)["tokens"]
        peak = cg.read("memory.max_usage_in_bytes")
        assert peak < MOE_LIMIT and cg.read("memory.failcnt") == 0
    assert out["experts"]["misses"] > 0  # experts really streamed
    return out["experts"], peak


def test_expert_streaming_runs_a_moe_model_larger_than_the_limit(big_moe):
    """A 4-bit MoE model of ~1 GB (64 experts, top-4) under a 500 MB cgroup: plain mlx-lm
    is killed; an expert cache of 12.5% of each layer's experts generates mlx-lm's tokens
    of an unconstrained run, never touching the limit."""
    with MemoryCgroup(MOE_LIMIT) as cg:
        plain = cg.run([PYTHON, "-c", MOE_GENERATE, "mlx-lm", str(big_moe), str(N_TOKENS)],
                       timeout=600, cwd=str(big_moe))
        assert plain.returncode != 0, "plain mlx-lm fitted under the limit: the proof is void"
        print(f"plain mlx-lm under {MOE_LIMIT} bytes: exit {plain.returncode}")
    ex, peak = _experts_stream_under_the_limit(big_moe, "mlx-lm", cwd=str(big_moe))
    print(f"expert cache 12.5%: peak cgroup usage {peak} of limit {MOE_LIMIT}, banks "
          f"{ex['bank_bytes']} bytes, hit rate {ex['hit_rate']:.2f}, "
          f"{ex['bytes_read']} bytes of experts read")


GGUF_GENERATE = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    import pyloader
    path, resident, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, _ = pyloader.load_model(path, kernels="auto", tokenizer=False,
                                   resident=1.0 if resident == "all" else 0,
                                   options=pyloader.StreamOptions(prefetch=1))
    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8])
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]
    print(json.dumps({"tokens": tokens}))
""")


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory):
    from gguf_inplace_files import write_model

    path = tmp_path_factory.mktemp("big-gguf") / "model.gguf"
    write_model(path, "llama", "F16", embed="Q8_0", with_exact=False,
                sizes={"hidden": 2048, "ffn": 5632, "n_layer": 14, "head_dim": 128,
                       "n_head": 16, "n_kv": 4})
    assert path.stat().st_size > 2 * LIMIT, path.stat().st_size
    return path


def test_a_gguf_file_larger_than_the_limit_streams_in_place(big_gguf):
    """A 1.3 GB GGUF file under a 600 MB cgroup, read in place and streamed layer by
    layer: the resident run's tokens, without reaching the limit."""
    import subprocess

    free = subprocess.run([PYTHON, "-c", GGUF_GENERATE, str(big_gguf), "all", str(N_TOKENS)],
                          capture_output=True, text=True, timeout=600)
    assert free.returncode == 0, free.stderr[-2000:]
    reference = json.loads(free.stdout)["tokens"]
    with MemoryCgroup(LIMIT) as cg:
        out = cg.run([PYTHON, "-c", GGUF_GENERATE, str(big_gguf), "0", str(N_TOKENS)],
                     timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout)["tokens"] == reference
        peak = cg.read("memory.max_usage_in_bytes")
        print(f"GGUF in place, streamed: peak cgroup usage {peak} of limit {LIMIT}")
        assert peak < LIMIT and cg.read("memory.failcnt") == 0


@pytest.fixture(scope="module")
def big_moe_gguf(tmp_path_factory):
    from gguf_inplace_files import write_model

    path = tmp_path_factory.mktemp("big-moe-gguf") / "model.gguf"
    write_model(path, "qwen3moe", "Q4_K", embed="Q8_0", experts=True, with_exact=False,
                sizes={"hidden": 1024, "n_head": 8, "n_kv": 2, "head_dim": 128,
                       "n_layer": 12, "n_expert": 64, "n_used": 4, "expert_ffn": 768})
    assert path.stat().st_size > 1.8 * MOE_LIMIT, path.stat().st_size
    return path


def test_a_moe_gguf_file_larger_than_the_limit_streams_its_experts(big_moe_gguf):
    """A ~1 GB qwen3moe GGUF (Q4_K, 64 experts, top-4) under a 500 MB cgroup, read in place
    with an expert cache of 12.5% of each layer's experts: the tokens of the resident run,
    without reaching the limit."""
    env = {**os.environ, "PYLOADER_KERNELS": "auto"}  # its blocks computed in place
    ex, peak = _experts_stream_under_the_limit(big_moe_gguf, "all", "256", env=env)  # its vocab
    print(f"MoE GGUF in place, experts streamed: peak cgroup usage {peak} of limit "
          f"{MOE_LIMIT}, banks {ex['bank_bytes']} bytes, {ex['bytes_read']} bytes read")
