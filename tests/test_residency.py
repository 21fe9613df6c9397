"""Budget calculator, planner, memory probes and the pressure monitor (injected probes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import pyloader
from models import make_model_dir
from proc_files import require_proc
from pyloader._util import host, memory
from pyloader.residency import planner
from pyloader.streaming import controller_of
from pyloader.residency.budget import LayerCache, ModelBudget, model_budget
from pyloader.residency import Calibration, PressureMonitor, pass_time, plan, predict
from pyloader.residency import Headroom, KVSpec, PressureSettings

# Public config.json values (Hugging Face model repositories), trimmed to what matters.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 152064}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
    "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "torch_dtype": "float32", "vocab_size": 256000}


# ----------------------------------------------------------------------------
# Budget


@pytest.mark.parametrize("config,expected", [(LLAMA_31_8B, 131_072), (QWEN25_7B, 57_344),
                                             (GEMMA2_9B, 344_064)],
                         ids=["llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b"])
def test_seed_kv_bytes_per_token_fp16(config, expected):
    b = model_budget(config, kv_dtype="float16")
    assert b.kv_bytes_per_token == expected
    # 2 × layers × kv heads × head dim × 2 bytes, every layer keeping KV
    assert b.kv_layers == config["num_hidden_layers"]
    # 8-bit: packed uint32 + fp16 scale and bias per group of 64
    d = expected // (2 * 2 * b.kv_layers)  # kv_heads × head_dim
    q8 = model_budget(config, kv_dtype="float16", kv_bits=8).kv_bytes_per_token
    q4 = model_budget(config, kv_dtype="float16", kv_bits=4).kv_bytes_per_token
    assert q8 == 2 * b.kv_layers * (d + 2 * 2 * d // 64)
    assert q4 == 2 * b.kv_layers * (d // 2 + 2 * 2 * d // 64)
    assert b.kv_bytes(1000) == 1000 * expected


def test_config_weights_of_a_known_model():
    b = model_budget(LLAMA_31_8B)
    assert b.weights_bytes == 8_030_261_248 * 2  # Llama-3.1-8B: 8.03 B parameters in bf16
    assert b.nonlayer_bytes == (2 * 128256 * 4096 + 4096) * 2
    q = model_budget(LLAMA_31_8B, quantization={"bits": 4, "group_size": 64})
    # every Linear/Embedding: bits/8 per weight + bf16 scale and bias per 64 weights
    assert 0.27 < q.weights_bytes / b.weights_bytes < 0.29


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {(arch, bits): make_model_dir(root / f"{arch}-{bits}", arch, bits=bits)
            for arch in ("llama", "qwen3", "gemma3_text", "qwen3_5") for bits in (None, 4)}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_5"])
@pytest.mark.parametrize("bits", [None, 4])
def test_config_bytes_equal_the_checkpoint_index(tiny, arch, bits):
    """Weights computed from config shapes (+ quantization) = the bytes in the index."""
    path = tiny[(arch, bits)]
    from_index = model_budget(path)
    assert from_index.source == "checkpoint"
    assert from_index.weights_bytes == pyloader.open(path).total_nbytes
    cfg = json.loads((path / "config.json").read_text())
    from_config = model_budget(cfg)
    assert from_config.source == "config"
    assert from_config.layer_bytes == from_index.layer_bytes
    assert from_config.nonlayer_bytes == from_index.nonlayer_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_5"])
def test_kv_layers_match_the_kv_cache_planner(tiny, arch):
    """Per-token bytes of growing KV layers equal pyloader.kv's arena per token; sliding
    windows are capped, linear-attention layers constant."""
    path = tiny[(arch, None)]
    model, _ = mlx_lm_load_model(path)
    b = model_budget(path)
    for bits in (None, 8, 4):
        arena = pyloader.plan_kv_cache(model, 512, kv_bits=bits, kv_group_size=16)
        bb = model_budget(path, kv_bits=bits, kv_group_size=16) if bits else b
        grow = sum(c.bytes_per_token for c in bb.caches if c.kind == "kv")
        assert grow * arena.capacity == arena.nbytes
    kinds = [c.kind for c in b.caches]
    if arch == "gemma3_text":
        assert kinds == ["window", "window", "window", "kv"]
        assert b.kv_bytes(1000) == b.kv_bytes_per_token // 4 * (1000 + 3 * 4)
    elif arch == "qwen3_5":
        assert kinds == ["state", "kv", "state", "kv"]
        assert b.kv_bytes(2000) - b.kv_bytes(1000) == 1000 * b.kv_bytes_per_token
        assert b.kv_bytes(1) > b.kv_bytes_per_token  # the constant states
    else:
        assert set(kinds) == {"kv"}


def _budget(layer_bytes, nonlayer=100, kv_per_token=10) -> ModelBudget:
    return ModelBudget(
        source="config", name="t", model_type="llama", weights_dtype="bfloat16",
        quantization=None, kv_bits=None, kv_dtype="bfloat16", nonlayer_bytes=nonlayer,
        layer_bytes=list(layer_bytes), caches=[LayerCache("kv", kv_per_token)] * len(layer_bytes),
        hidden_size=1, intermediate_size=1, vocab_size=1, num_heads=1,
        max_position_embeddings=10_000, compute_bytes=sum(layer_bytes))


def test_fits_and_max_context_boundary():
    b = model_budget(LLAMA_31_8B, quantization={"bits": 4, "group_size": 64})
    budget = 6 * 10**9
    n = b.max_context(budget)
    assert 0 < n < 131072
    assert b.fits(budget, n) and not b.fits(budget, n + 1)
    assert b.max_context(b.weights_bytes) == 0  # weights alone fill it
    assert b.max_context(10**12) == 131072       # capped at the model's maximum
    k = b.resident_layer_count(4 * 10**9, 1024)
    assert b.fits(4 * 10**9, 1024, sorted(range(32), key=lambda i: b.layer_bytes[i])[:k])
    assert 0 < k < 32


# ----------------------------------------------------------------------------
# Planner


def test_plan_honours_non_uniform_layer_sizes():
    from pyloader.residency import choose_layers

    b = _budget([50, 10, 50, 10, 50, 10], nonlayer=0)

    def cal(overhead):
        return Calibration(disk_bytes_per_s=1.0, decode_s_per_byte=0.1,
                           prefill_s_per_byte_token=0.1, unit_overhead_s=overhead,
                           prefill_tokens=8, source="machine", key="t")

    assert choose_layers(b, 180, cal(0.0), 100) == tuple(range(6))  # all fit: no buffers needed
    # 170 bytes of room, 100 held back for streaming buffers: 70 for layers.
    assert choose_layers(b, 170, cal(0.0), 100) == (0, 1, 3)
    assert choose_layers(b, 140, cal(1.0), 100) == (1, 3, 5)  # 40: the big ones cannot fit
    assert choose_layers(b, 100, cal(1.0), 100) == ()
    # The choice is the fastest of every set that fits (exhaustive check).
    import itertools

    for room, overhead in ((70, 0.0), (70, 5.0), (40, 1.0), (65, 30.0)):
        c = cal(overhead)
        chosen = choose_layers(b, room + 100, c, 100)
        t = predict(b, chosen, c)["decode_s_per_token"]
        for k in range(7):
            for subset in itertools.combinations(range(6), k):
                if sum(b.layer_bytes[i] for i in subset) <= room:
                    assert t <= predict(b, subset, c)["decode_s_per_token"] + 1e-9, \
                        (room, overhead, chosen, subset)


def _random_case(rng):
    n = rng.randint(2, 7)
    lb = [rng.choice([10, 20, 50, 100]) for _ in range(n)]
    cal = Calibration(disk_bytes_per_s=rng.choice([0.5, 1, 5, 20]),
                      decode_s_per_byte=rng.choice([0.01, 0.05, 0.1]),
                      prefill_s_per_byte_token=0.1, unit_overhead_s=rng.choice([0, 0.5, 2]),
                      prefill_tokens=8, source="machine", key="t",
                      release_s_per_byte=rng.choice([0, 0.01]))
    return _budget(lb, nonlayer=rng.choice([0, 30])), cal


def test_read_strategy_pread_only_for_large_streamed_layers():
    big = planner.PREAD_MIN_LAYER_BYTES
    layers = [big - 1, big, big - 1]
    assert planner.read_strategy(layers, {0, 1, 2}) == "mmap"  # nothing streamed
    assert planner.read_strategy(layers, {1}) == "mmap"        # streamed ones are small
    assert planner.read_strategy(layers, {0, 2}) == "pread"    # the large one is streamed
    assert planner.read_strategy(layers, set()) == "pread"


def test_pread_prediction_reads_at_disk_speed_and_drops_nothing():
    """The cost model of a pread stream (O_DIRECT into fixed buffers): reads at the
    disk's bandwidth, no page-cache drop; mmap's at the fitted streaming bandwidth with
    its drop cost. With a slow fitted stream and a costly drop, pread predicts faster;
    with nothing streamed both are the compute alone."""
    m = _budget([100 << 20] * 4)
    cal = Calibration(disk_bytes_per_s=2e9, decode_s_per_byte=1e-9,
                      prefill_s_per_byte_token=1e-10, unit_overhead_s=1e-3,
                      prefill_tokens=8, source="machine", key="t",
                      stream_bytes_per_s=0.5e9, release_s_per_byte=2e-9)
    mm = predict(m, (), cal, strategy="mmap")["decode_s_per_token"]
    pr = predict(m, (), cal, strategy="pread")["decode_s_per_token"]
    assert pr < mm
    assert pr == pytest.approx(pass_time(m, (), 1e-9, 1e-3, 0.0, 2e9), rel=1e-9)
    everything = tuple(range(4))
    assert (predict(m, everything, cal, strategy="pread")
            == predict(m, everything, cal, strategy="mmap"))
    with pytest.raises(ValueError, match="strategy"):
        predict(m, (), cal, strategy="mlx")
    # A calibration that measured pread's direct reads predicts with them (here slower
    # than the page-cache figure, so the pass becomes read-bound).
    cal.direct_bytes_per_s = 0.1e9
    direct = predict(m, (), cal, strategy="pread")["decode_s_per_token"]
    assert direct == pytest.approx(pass_time(m, (), 1e-9, 1e-3, 0.0, 0.1e9), rel=1e-9)
    assert direct > pr


def test_pipeline_model_is_monotone_and_pipelines():
    """Keeping one more layer resident never makes the simulated pass slower; a lone
    streamed layer's read overlaps the rest of the pass (it is requested again when
    it is released), and with prefetch 0 reads and streamed compute add up."""
    import random

    rng = random.Random(2)
    for _ in range(1000):
        b, cal = _random_case(rng)
        n = b.n_layers
        prefetch = rng.choice([0, 1, 2])
        res = set(rng.sample(range(n), rng.randint(0, n - 1)))
        j = rng.choice([i for i in range(n) if i not in res])
        slower = predict(b, res, cal, prefetch=prefetch)["decode_s_per_token"]
        faster = predict(b, res | {j}, cal, prefetch=prefetch)["decode_s_per_token"]
        assert faster <= slower * (1 + 1e-9), (b.layer_bytes, res, j, prefetch)

    # Four 100-byte layers, k = 0.01 s/byte (1 s each), reads 0.5 s each, no fixed costs.
    b = _budget([100] * 4, nonlayer=0)
    cal = Calibration(disk_bytes_per_s=200, decode_s_per_byte=0.01, prefill_s_per_byte_token=0.01,
                      unit_overhead_s=0.0, prefill_tokens=8, source="machine", key="t")
    assert predict(b, {0, 1, 2}, cal)["decode_s_per_token"] == pytest.approx(4.0)  # hidden
    # prefetch 0: a read overlaps only the resident layers computed before it.
    assert predict(b, {0, 1, 2}, cal, prefetch=0)["decode_s_per_token"] == pytest.approx(4.0)
    assert predict(b, {1, 2, 3}, cal, prefetch=0)["decode_s_per_token"] == pytest.approx(4.5)
    assert predict(b, (), cal, prefetch=0)["decode_s_per_token"] == pytest.approx(6.0)
    # Reads slower than compute: all streamed, the reads (4 × 2 s) set the pace.
    slow = Calibration(**{**cal.to_dict(), "disk_bytes_per_s": 50})
    assert predict(b, (), slow)["decode_s_per_token"] == pytest.approx(8.0)
    # mmap's release runs on the reader's drop thread: off the compute clock, but the
    # read requested after it waits for it. Two streamed layers, prefetch 1: unit j+2's
    # read is requested when j+1 starts, after j's release. A 0.5 s release leaves the
    # pass compute-bound (2 × 1 s); with a 1 s one, 0.5 s of the next read hides behind
    # the next compute and one of the two units waits 0.5 s (on the compute thread, as
    # before, 2 × (1 + 1) s).
    two = _budget([100] * 2, nonlayer=0)
    for drop, expected in ((0.005, 2.0), (0.01, 2.5)):
        c = Calibration(**{**cal.to_dict(), "release_s_per_byte": drop})
        assert predict(two, (), c)["decode_s_per_token"] == pytest.approx(expected), drop


def test_choice_is_close_to_exhaustive_under_the_pipeline_model():
    """The knapsack + local search choice against every set that fits, on random
    small models (the pipelined pass is not additive, so this is not exact)."""
    import itertools
    import random
    from pyloader.residency import choose_layers

    rng = random.Random(1)
    worst = 0.0
    for _ in range(200):
        b, cal = _random_case(rng)
        lb = b.layer_bytes
        room = rng.randint(0, sum(lb))
        t = predict(b, choose_layers(b, room + 100, cal, 100), cal)["decode_s_per_token"]
        best = min(predict(b, s, cal)["decode_s_per_token"]
                   for k in range(len(lb) + 1) for s in itertools.combinations(range(len(lb)), k)
                   if sum(lb[i] for i in s) <= room)
        worst = max(worst, t / best - 1)
    print(f"worst excess over the exhaustive best: {worst:.1%}")
    assert worst <= 0.10


@pytest.mark.parametrize("priority,tokens", [("max_tps", 512), ("balanced", 1024),
                                             ("max_context", 8192)])
def test_plan_priorities_and_budget(priority, tokens):
    p = plan(LLAMA_31_8B, "10GB", kv=KVSpec(context=8192, priority=priority),
             calibration=None)
    assert p.kv_reserve_tokens == tokens
    assert p.table.kv_cache == tokens * 131_072
    assert p.fits and p.expected_peak <= 10**10
    assert not p.fits_all_resident
    assert 0 < len(p.resident_layers) < 32
    more = plan(LLAMA_31_8B, "12GB", kv=KVSpec(context=8192, priority=priority),
                calibration=None)
    assert len(more.resident_layers) > len(p.resident_layers)
    d = p.to_dict()
    for key in ("kv_bytes_per_token", "weights_bytes", "fits", "max_context", "resident_layers"):
        assert key in d


def test_plan_auto_uses_the_probes(monkeypatch):
    snap = memory.MemorySnapshot(time=0.0, mem_available=10**12, cgroup_limit=5 * 10**9,
                                 cgroup_usage=10**9)
    monkeypatch.setattr(planner, "read_memory", lambda: snap)
    p = plan(model_budget(LLAMA_31_8B, quantization={"bits": 4, "group_size": 64}),
             Headroom(reserve=0), calibration=None)
    assert p.budget_source == "auto" and p.budget_bytes == 4 * 10**9


# ----------------------------------------------------------------------------
# Probes


def test_cgroup_probes_v1_and_v2(tmp_path):
    v1 = tmp_path / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("1000000\n")
    (tmp_path / "pc1").write_text("12:memory:/job\n0::/\n")
    assert memory.cgroup_memory_path(str(tmp_path), str(tmp_path / "pc1")) == (1, v1)
    v2 = tmp_path / "slice"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    (tmp_path / "pc2").write_text("0::/slice\n")
    assert memory.cgroup_memory_path(str(tmp_path), str(tmp_path / "pc2")) == (2, v2)
    assert memory._int_or_max("max\n") == (True, None)
    assert memory._int_or_max("9223372036854771712") == (True, None)
    from pyloader._util.procfs import parse_psi
    assert parse_psi("some avg10=1.50 avg60=0 avg300=0 total=1\n"
                     "full avg10=0.25 avg60=0 avg300=0 total=1\n") == (1.5, 0.25)
    assert parse_psi(None) == (None, None)
    s = memory.MemorySnapshot(time=0, mem_available=500, cgroup_limit=1000, cgroup_usage=800)
    assert s.headroom == 200
    s = memory.MemorySnapshot(time=0, mem_available=100, cgroup_limit=1000, cgroup_usage=800)
    assert s.headroom == 100


def test_runnable_tasks_count_the_caller():
    from pyloader._util.procfs import other_runnable, runnable_tasks

    if runnable_tasks() is None:  # no /proc/stat (not Linux, or PYLOADER_NO_PROC)
        assert other_runnable(samples=2, interval=0) is None  # callers use the load average
        return
    assert runnable_tasks() >= 1  # this thread is running while it reads
    others = other_runnable(samples=3, interval=0.01)
    assert others is not None and 0 <= others < 1000


def test_read_memory_here():
    mx.eval(mx.ones(1000))
    s = memory.read_memory()
    assert s.headroom and s.headroom > 0
    assert s.peak_rss and s.peak_rss > 0
    if host.process_memory().rss is not None:  # None without /proc elsewhere than macOS
        assert s.rss and s.rss_anon is not None and s.rss_file is not None
    assert s.mlx_peak >= 4000
    require_proc("/proc/meminfo")
    with open("/proc/meminfo") as f:
        assert "MemAvailable" in f.read() and s.mem_available > 0


# ----------------------------------------------------------------------------
# Pressure monitor with an injected probe

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 5, 9, 11, 200]


def _greedy(model, n=30):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


class Script:
    """A probe replaying headroom readings (in layer units), then `tail` forever."""

    def __init__(self, unit, readings, tail):
        self.unit, self.readings, self.tail, self.i = unit, list(readings), tail, 0

    def __call__(self):
        v = self.readings[self.i] if self.i < len(self.readings) else self.tail
        self.i += 1
        return int(v * self.unit)


@pytest.mark.parametrize("arch,bits,strategy", [("llama", None, "mmap"), ("qwen3", 4, "pread"),
                                                ("qwen3_5", None, "mmap"),
                                                ("gemma3_text", 4, "pread")])
def test_shed_and_readmit_keep_tokens_identical(tiny, arch, bits, strategy):
    path = tiny[(arch, bits)]
    reference = _greedy(mlx_lm_load_model(path)[0])
    model, _ = pyloader.load_model(path, resident=1.0,
                                   options=pyloader.StreamOptions(strategy=strategy))
    n = len(model.layers)
    unit = max(controller_of(model).layout.layer_bytes)
    # falls (sustained), stays low, then recovers for good
    probe = Script(unit, [50, 50, 50, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], tail=100)
    mon = PressureMonitor(model, PressureSettings(low_water=unit, high_water=2 * unit,
                                                  window=3, cooldown=2), probe=probe).attach()
    assert _greedy(model) == reference
    actions = [(e.action, e.layers) for e in mon.events]
    assert actions[0][0] == "shed" and actions[0][1][-1] == n - 1  # highest index first
    admits = [a for a in actions if a[0] == "admit"]
    assert sorted(i for _, ls in admits for i in ls) == sorted(actions[0][1])
    assert controller_of(model).layout.resident == set(range(n))
    assert pyloader.stats(model)["streamed_units"] == 0
    mon.detach()
    assert _greedy(model) == reference


def test_a_single_low_reading_never_sheds(tiny):
    model, _ = pyloader.load_model(tiny[("llama", None)], resident=1.0)
    unit = max(controller_of(model).layout.layer_bytes)
    probe = Script(unit, [50, 0, 50, 50, 0, 50, 0, 0, 50, 50], tail=50)
    mon = PressureMonitor(model, PressureSettings(low_water=unit, high_water=2 * unit,
                                                  window=3), probe=probe).attach()
    _greedy(model, 12)
    assert mon.events == []


def test_noise_around_the_marks_does_not_oscillate(tiny):
    """Readings jittering between low and high water: at most the first shed, never a
    re-admit (it needs high water + the layer + streaming memory), never a flip-flop."""
    model, _ = pyloader.load_model(tiny[("llama", None)], resident=1.0)
    unit = max(controller_of(model).layout.layer_bytes)
    jitter = [0.5, 0.5, 0.5] + [0.9, 2.5, 1.2, 2.9, 1.1, 2.2] * 10
    mon = PressureMonitor(model, PressureSettings(low_water=unit, high_water=2 * unit,
                                                  window=3, cooldown=1),
                          probe=Script(unit, jitter, 2.0)).attach()
    _greedy(model, 60)
    assert [e.action for e in mon.events] == ["shed"]


def test_headroom_a_shed_itself_freed_does_not_readmit(tiny):
    """A shed frees up to a layer more than it needs, and reclaimed page cache can add
    more: readings that settle at the admit threshold right after a shed are what the
    shed did, not a recovery, and re-admit nothing; memory given back from outside
    (growth past high - low water over the first window after the shed) re-admits."""
    model, _ = pyloader.load_model(tiny[("llama", None)], resident=1.0)
    unit = max(controller_of(model).layout.layer_bytes)
    plateau = 4.5  # >= high water + a layer + one streaming unit (4 units)
    readings = [0.5] * 3 + [plateau] * 20 + [plateau + 1.2] * 20
    mon = PressureMonitor(model, PressureSettings(low_water=unit, high_water=2 * unit,
                                                  window=3, cooldown=1),
                          probe=Script(unit, readings, plateau + 1.2)).attach()
    _greedy(model, 40)
    events = [(e.call, e.action) for e in mon.events]
    assert events[0] == (3, "shed"), events
    admits = [c for c, a in events if a == "admit"]
    assert admits and min(admits) > 3 + 20, events  # not on the plateau, only after growth


def test_monitor_arguments(tiny):
    model, _ = pyloader.load_model(tiny[("llama", None)], resident=1.0)
    with pytest.raises(ValueError, match="high_water"):
        PressureMonitor(model, PressureSettings(low_water=10, high_water=10), probe=lambda: 0)
    with pytest.raises(ValueError, match="single reading"):
        PressureMonitor(model, PressureSettings(window=1), probe=lambda: 0)
    with pytest.raises(ValueError, match="load_model"):
        PressureMonitor(mlx_lm_load_model(tiny[("llama", None)])[0], probe=lambda: 0)


def test_load_model_accepts_a_planned_resident_set(tiny):
    path = tiny[("qwen3", 4)]
    model, _ = pyloader.load_model(path, resident={1})
    assert pyloader.stats(model)["resident_layers"] == [1]
    assert pyloader.stats(model)["streamed_units"] == 1
    assert _greedy(model) == _greedy(mlx_lm_load_model(path)[0])
    with pytest.raises(ValueError, match="range"):
        pyloader.load_model(path, resident={5})


# ----------------------------------------------------------------------------
# CLI


def test_cli_plan_json_and_table(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_31_8B))
    run = [sys.executable, "-m", "pyloader", "plan", str(cfg), "--ram", "6GB",
           "--context", "4096", "--bits", "4", "--no-predict"]
    out = subprocess.run(run + ["--json"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["kv_bytes_per_token"] == 131_072
    assert d["fits"] is True and 0 < d["max_context"] < 131072
    assert d["resident_layers"] == list(range(32))
    assert d["weights_bytes"] == d["model"]["weights_bytes"]
    out = subprocess.run(run + ["--kv-bits", "8", "--priority", "max_context"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "fits" in out.stdout and "69,632 B/token" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "pyloader", "plan", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "no such" in bad.stderr


def test_plan_counts_the_kv_dtype_the_cache_really_uses():
    """The default model keeps float32 norms beside float16 scales: it computes (and
    make_kv_cache stores) keys and values in float32, 46,080 B/token; the plan counted
    bfloat16 (23,040) from the config before."""
    from mlx_lm import load as mlx_lm_load

    path = pyloader.default_model_path()
    budget = model_budget(path)
    model, _ = mlx_lm_load(str(path))
    kv = pyloader.plan_kv_cache(model, 1024)
    assert budget.kv_dtype == str(kv.dtype).rsplit(".", 1)[-1] == "float32"
    assert budget.kv_bytes_per_token == kv.nbytes // 1024 == 46_080


@pytest.mark.parametrize("case", ["measured", "contended", "cached-slowly", "recalibrated"])
def test_cli_plan_says_what_it_did_about_the_calibration(case, monkeypatch, capsys):
    """plan's line about its calibration: "measured in N s, cached" after measuring,
    "under contention (...): reused for an hour" when measured under load, nothing when
    it reused a cached one, even one that took seconds to load (it said "measured"
    whenever that took more than 1 s)."""
    import time as time_module

    from pyloader import residency
    from pyloader.cli import main
    from pyloader.residency import Calibration

    cal = Calibration(disk_bytes_per_s=1e9, decode_s_per_byte=1e-9,
                      prefill_s_per_byte_token=1e-10, unit_overhead_s=1e-4,
                      prefill_tokens=64, source="machine", key="k",
                      detail={"contended": "load average 3.0"} if case == "contended" else {})
    calls = []

    def measure(*args, **kwargs):
        calls.append("measure")
        return cal

    def cached(*args, **kwargs):
        if case != "cached-slowly":
            return None
        time_module.sleep(1.2)  # a slow disk, or a busy machine
        return cal

    monkeypatch.setattr(residency, "cached_calibration", cached)
    monkeypatch.setattr(residency, "calibrate_machine", measure)
    monkeypatch.setattr(residency, "calibrate", measure)
    argv = ["plan", str(pyloader.default_model_path()), "--ram", "2GB"]
    assert main(argv + (["--calibrate"] if case == "recalibrated" else [])) == 0
    err = capsys.readouterr().err
    if case == "cached-slowly":
        assert not calls and "measur" not in err, err
        return
    assert calls == ["measure"]
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(r"measured in [0-9]+ s" + (
        r", under contention \(load average 3.0\): reused for an hour, then measured again"
        if case == "contended" else ", cached"), line), line


@pytest.mark.parametrize("kernels", ["auto", "mlx"])
def test_cli_plan_calibrates_the_kernels_it_is_given(kernels, monkeypatch, capsys):
    """``pyloader plan --kernels``: the cached calibration it looks for and the one it
    measures are those of the kernels the model will compute with."""
    from pyloader import residency
    from pyloader.cli import main
    from pyloader.residency import Calibration

    cal = Calibration(disk_bytes_per_s=1e9, decode_s_per_byte=1e-9,
                      prefill_s_per_byte_token=1e-10, unit_overhead_s=1e-4,
                      prefill_tokens=64, source="machine", key="k")
    asked, measured = [], []
    monkeypatch.setattr(residency, "cached_calibration",
                        lambda *a, kernels=None: asked.append(kernels))
    monkeypatch.setattr(residency, "calibrate_machine",
                        lambda fmt: measured.append(fmt.kernels) or cal)
    argv = ["plan", str(pyloader.default_model_path()), "--ram", "2GB", "--kernels", kernels]
    assert main(argv) == 0
    assert asked == [kernels] and measured == [kernels], capsys.readouterr().err


def test_cli_plan_that_fits_nothing_exits_1_naming_the_smallest_budget(tmp_path):
    path = str(pyloader.default_model_path())
    run = [sys.executable, "-m", "pyloader", "plan", path, "--no-predict"]
    out = subprocess.run(run[:-1] + ["--ram", "100MB"], capture_output=True, text=True,
                         cwd="/")
    assert out.returncode == 1, out.stderr
    assert "KV float32" in out.stdout and "46,080 B/token" in out.stdout
    assert "the smallest budget that fits is" in out.stdout
    # No speed for a plan that cannot run, and so nothing measured for one.
    assert "predicted  decode" not in out.stdout and "measuring" not in out.stderr
    out = subprocess.run(run + ["--ram", "100MB", "--json"], capture_output=True, text=True,
                         cwd="/")
    d = json.loads(out.stdout)
    assert out.returncode == 1 and d["fits"] is False and d["prediction"] is None
    least = d["min_budget_bytes"]
    assert 100e6 < least < d["table_all_resident"]["total"]
    # The smallest budget it names fits (exit 0), a byte less does not.
    fit = subprocess.run(run + ["--ram", str(least), "--json"], capture_output=True,
                         text=True, cwd="/")
    assert fit.returncode == 0 and json.loads(fit.stdout)["fits"] is True
    assert json.loads(fit.stdout)["resident_layers"] == []
    short = subprocess.run(run + ["--ram", str(least - 1)], capture_output=True, text=True,
                           cwd="/")
    assert short.returncode == 1


# ----------------------------------------------------------------------------
# The machine calibration's format and its conditions (a calibration measured under
# contention would mislead every later plan)


@pytest.mark.parametrize("dtype,bits,weights,activation", [
    (mx.float32, None, "float32", "float32"),
    (mx.float16, None, "float16", "float16"),
    (mx.bfloat16, None, "bfloat16", "bfloat16"),
    (mx.bfloat16, 4, "bfloat16", "bfloat16"),
    (mx.float16, 8, "float16", "float16"),
], ids=["f32", "f16", "bf16", "q4-bf16", "q8-f16"])
def test_compute_format_from_the_checkpoint(tmp_path, dtype, bits, weights, activation):
    """The calibration's format is what the model computes in: the matrices' dtype (the
    scales' for a quantized model), the activations' dtype, the quantization and the
    model's own shapes; every format has its own key."""
    from pyloader.residency import compute_format

    path = make_model_dir(tmp_path / "m", "llama", dtype=dtype, bits=bits)
    b = model_budget(path)
    f = compute_format(b, path)
    assert (f.weights, f.activation) == (weights, activation)
    assert (f.bits, f.group_size) == ((bits, b.quantization["group_size"]) if bits
                                      else (None, None))
    h, i = b.hidden_size, b.intermediate_size
    assert f.shapes == ((i, h), (h, i), (h, h))
    assert f.key.startswith(f"q{bits}g" if bits else "w") and f"a{activation}" in f.key
    # The probe's streamed units: the median layer's size (1-32 MiB) in ranges of the
    # layer's average tensor size (as many as its tensors make of a unit that size).
    from pyloader.io.checkpoint import Checkpoint
    ckpt = Checkpoint(path)
    layer0 = [ckpt[n] for n in ckpt.keys() if n.startswith("model.layers.0.")]
    assert len(layer0) == (23 if bits else 9)
    layer_bytes = sum(t.nbytes for t in layer0)
    assert f.unit_bytes >= 2**20 and f.unit_bytes % 2**20 == 0
    assert f.unit_tensors == max(1, round(len(layer0) * f.unit_bytes / layer_bytes))
    assert f"-u{f.unit_bytes >> 20}m{f.unit_tensors}t" in f.key


def test_float32_norms_make_float32_activations(tmp_path):
    """A bf16 / 4-bit model whose norms are float32 (a GGUF conversion) computes in
    float32: the format follows the tensors, not the config's dtype — and the key differs
    from the one the config alone gives."""
    from pyloader.residency import compute_format

    for bits in (None, 4):
        path = make_model_dir(tmp_path / f"m{bits}", "llama", dtype=mx.bfloat16, bits=bits)
        weights = mx.load(str(path / "model.safetensors"))
        weights = {k: v.astype(mx.float32) if "norm" in k else v for k, v in weights.items()}
        mx.save_safetensors(str(path / "model.safetensors"), weights)
        b = model_budget(path)
        f = compute_format(b, path)
        assert (f.weights, f.activation) == ("bfloat16", "float32")
        from_config = compute_format(b)
        assert from_config.activation == "bfloat16" and from_config.key != f.key


def test_compute_format_from_a_config():
    from pyloader.residency import ComputeFormat, compute_format
    from pyloader.residency.formats import promote

    f = compute_format(model_budget(LLAMA_31_8B))
    assert (f.weights, f.activation, f.bits) == ("bfloat16", "bfloat16", None)
    assert f.shapes == ((14336, 4096), (4096, 14336), (4096, 4096))
    q = compute_format(model_budget(LLAMA_31_8B, quantization={"bits": 4, "group_size": 64}))
    assert (q.bits, q.group_size) == (4, 64) and q.key != f.key
    # Without a checkpoint: 9 tensors (23 quantized) a layer, estimated. An 8B bf16 layer
    # (436 MB) is probed in the largest unit, 128 MiB: 3 of its 9 tensors' worth; the
    # 4-bit one (123 MB) as it is, in 23 ranges.
    assert f.unit_bytes == 128 << 20 and q.unit_bytes == 117 << 20
    assert (f.unit_tensors, q.unit_tensors) == (3, 23)
    assert promote(["bfloat16", "float16"]) == "float32" and promote(["float16"]) == "float16"
    assert promote(["uint32"]) is None
    with pytest.raises(ValueError, match="activation"):
        ComputeFormat("bfloat16", "int8")
    with pytest.raises(ValueError, match="together"):
        ComputeFormat("bfloat16", "bfloat16", bits=4)


@pytest.fixture
def quick_machine_probe(tmp_path, monkeypatch):
    """calibrate_machine without the disk probe and with a small matrix set: what is
    checked is what gets cached, not the numbers."""
    from pyloader.residency import machine as calibration

    monkeypatch.setenv("PYLOADER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "_measure_units",
                        lambda ckpt, unit, tensors: (1e9, 1e-10))
    monkeypatch.setattr(calibration, "_measure_direct", lambda ckpt: 2e9)
    # The emulated stream runs each unit's products once (they must work) and reports
    # a pass of 16 units in 10 ms cold, 8 ms warm.
    monkeypatch.setattr(calibration, "_emulate_stream",
                        lambda ckpt, unit, tensors, computes:
                        ([c() for c in computes], (0.01, 0.008, 16))[1])
    monkeypatch.setattr(calibration, "PROBE_BYTES", 1 << 16)
    (tmp_path / "cache" / "calibration").mkdir(parents=True)
    with open(tmp_path / "cache" / "calibration" / "disk-probe.safetensors", "wb") as f:
        f.truncate(4 * (calibration.MAX_UNIT_MIB << 20))  # sparse: exists, never read
    monkeypatch.setattr(calibration, "Checkpoint", lambda p: None)
    return calibration


def test_the_format_names_the_kernels_its_products_run_on(monkeypatch):
    """A format's products are computed by the kernels a load would use (pyloader's on
    the CPU unless PYLOADER_KERNELS=mlx); the two never share a cache entry, and MLX's
    keep the key they had before the kernels existed."""
    from pyloader.residency import ComputeFormat

    monkeypatch.delenv("PYLOADER_KERNELS", raising=False)
    auto = ComputeFormat("float16", "float16", bits=4, group_size=64)
    assert auto.kernels == "auto" and auto.key.endswith("-kpyloader")
    assert auto.to_dict()["kernels"] == "auto"
    mlx = ComputeFormat("float16", "float16", bits=4, group_size=64, kernels="mlx")
    assert mlx.key == auto.key[:-len("-kpyloader")]
    monkeypatch.setenv("PYLOADER_KERNELS", "mlx")
    assert ComputeFormat("float16", "float16", bits=4, group_size=64) == mlx
    # Off the CPU the replaced modules call MLX's ops: MLX's are the products to probe.
    from pyloader import kernels

    monkeypatch.delenv("PYLOADER_KERNELS")
    monkeypatch.setattr(kernels, "on_cpu", lambda: False)
    assert ComputeFormat("float16", "float16", kernels="auto").kernels == "mlx"
    with pytest.raises(ValueError, match="kernels"):
        ComputeFormat("float16", "float16", kernels="fast")


@pytest.mark.parametrize("kernels", ["auto", "mlx"])
def test_the_machine_probe_multiplies_with_the_formats_kernels(quick_machine_probe,
                                                               monkeypatch, kernels):
    """The probe's products are the model's linear layers computed by the format's
    kernels: pyloader's CPU kernels for ``auto`` (one to three orders of magnitude faster
    than MLX's in half precision here), MLX's ops for ``mlx``; the entry says which."""
    from mlx import nn

    from pyloader import kernels as kernels_mod
    from pyloader.residency import ComputeFormat

    cal_mod = quick_machine_probe
    monkeypatch.setattr(cal_mod, "conditions", lambda: dict(QUIET))
    for fmt in (ComputeFormat("float16", "float16", bits=4, group_size=64,
                              shapes=((64, 128),), kernels=kernels),
                ComputeFormat("bfloat16", "bfloat16", shapes=((64, 128),), kernels=kernels)):
        mats, widths, sizes, report = cal_mod._probe_matrices(fmt)
        base = nn.QuantizedLinear if fmt.quantized else nn.Linear
        ours = (kernels_mod.CpuQuantizedLinear if fmt.quantized else kernels_mod.CpuLinear)
        assert all(type(m) is (ours if kernels == "auto" else base) for m in mats)
        assert len(report.replaced) == (len(mats) if kernels == "auto" else 0)
        assert sum(sizes) >= cal_mod.PROBE_BYTES and widths == [128] * len(mats)
        cal = cal_mod.calibrate_machine(fmt)
        assert cal.detail["format"]["kernels"] == kernels
        assert cal.detail["kernel_report"] == report.summary()
        assert cal.key.endswith("-kpyloader") == (kernels == "auto")
        assert ("pyloader's CPU kernels" if kernels == "auto" else "MLX's ops") in cal.describe()


def test_a_checkpoints_calibration_is_kept_per_kernels(tmp_path, monkeypatch):
    """A checkpoint measured with MLX's ops is not the plan of the same checkpoint
    computed by pyloader's kernels, nor the other way round."""
    from pyloader import kernels as kernels_mod
    from pyloader.residency import calibration

    monkeypatch.setenv("PYLOADER_CACHE", str(tmp_path / "cache"))
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.float16, bits=4)
    keys = {k: calibration._model_key(path, "mmap", k) for k in ("auto", "mlx")}
    assert keys["auto"] != keys["mlx"]
    model, _ = pyloader.load_model(path, tokenizer=False, kernels="auto")
    assert kernels_mod.installed(model) == "auto"
    kernels_mod.install(model, "mlx")
    assert kernels_mod.installed(model) == "mlx"
    seen = []
    monkeypatch.setattr(calibration, "load_calibration", lambda key: seen.append(key))
    budget = model_budget(path)
    for k in ("auto", "mlx"):
        calibration.cached_calibration(path, budget, kernels=k)
    assert seen[0] == keys["auto"] and seen[2] == keys["mlx"]
    assert seen[1].endswith("-kpyloader") and not seen[3].endswith("-kpyloader")
    # plan() looks up the calibration of the kernels it is told about.
    asked = []
    monkeypatch.setattr(planner, "cached_calibration",
                        lambda p, m, kernels=None: asked.append(kernels))
    plan(path, 10**12, kernels="mlx")
    assert asked == ["mlx"]


QUIET = {"runnable_other": 0.05, "loadavg1": 0.1, "cpus": 2, "psi_cpu_some": 0.0,
         "psi_io_some": 0.0}
BUSY = {"runnable_other": 1.6, "loadavg1": 1.9, "cpus": 2, "psi_cpu_some": 35.0,
        "psi_io_some": 0.0}


def test_a_contended_calibration_is_cached_for_an_hour(quick_machine_probe, monkeypatch):
    """A busy machine is not re-measured on every plan: a contended calibration is cached,
    marked, for CONTENDED_LIFETIME_S, then measured again; it never replaces a settled
    one."""
    from pyloader.residency import ComputeFormat, contention

    cal_mod = quick_machine_probe
    assert contention(QUIET) is None
    assert "1.6 other tasks running on 2 CPUs" in contention(BUSY)
    assert "CPU pressure 35%" in contention(BUSY)
    # The load average still holds the last minute of this process's own work: with
    # nothing else running now it is not contention; it decides only where the runnable
    # count is unknown.
    assert contention({**QUIET, "loadavg1": 1.9}) is None
    assert "load average 1.90" in contention({**QUIET, "loadavg1": 1.9, "runnable_other": None})
    assert "other tasks" in contention({**QUIET, "runnable_other": 0.6})
    fmt = ComputeFormat("float32", "float32", shapes=((64, 64),))
    monkeypatch.setattr(cal_mod, "conditions", lambda: dict(BUSY))
    busy = cal_mod.calibrate_machine(fmt)
    assert "other tasks running" in busy.detail["contended"]
    assert busy.detail["conditions"]["before"] == BUSY
    cached = cal_mod.load_calibration(busy.key)  # cached, marked, for an hour ...
    assert cached is not None and cached.detail["contended"] == busy.detail["contended"]
    assert cached.detail["expires_at"] == busy.measured_at + cal_mod.CONTENDED_LIFETIME_S
    text = cached.describe()  # ... and it says so
    assert "MEASURED UNDER CONTENTION" in text and "reused until" in text
    # An hour later it has expired: the next plan measures again.
    later, now = busy.measured_at + cal_mod.CONTENDED_LIFETIME_S + 1, cal_mod.time.time
    monkeypatch.setattr(cal_mod.time, "time", lambda: later)
    assert cal_mod.load_calibration(busy.key) is None
    assert cal_mod.load_calibration(busy.key, expired=True) is not None
    monkeypatch.setattr(cal_mod.time, "time", now)
    monkeypatch.setattr(cal_mod, "conditions", lambda: dict(QUIET))
    quiet = cal_mod.calibrate_machine(fmt, force=True)
    if quiet.detail.get("contended"):  # the timings themselves did not settle here
        assert quiet.detail["contended"] == "the timings did not settle"
    else:
        cached = cal_mod.load_calibration(quiet.key)
        assert cached is not None and cached.detail["conditions"]["before"] == QUIET
        assert "CONTENTION" not in cached.describe()
        # A contended measurement now does not replace the settled one.
        monkeypatch.setattr(cal_mod, "conditions", lambda: dict(BUSY))
        assert cal_mod.calibrate_machine(fmt, force=True).detail["contended"]
        assert not cal_mod.load_calibration(quiet.key).detail.get("contended")
        assert "load 0.10 on 2 CPUs, 0.1 other tasks running" in cached.describe()
        assert "float32 activations" in cached.describe()


def test_unsettled_timings_are_marked(quick_machine_probe, monkeypatch):
    from pyloader.residency import ComputeFormat

    cal_mod = quick_machine_probe
    monkeypatch.setattr(cal_mod, "conditions", lambda: dict(QUIET))
    times = iter(range(1, 1000))
    monkeypatch.setattr(cal_mod, "_median_time", lambda fn, repeats: float(next(times)))
    cal = cal_mod.calibrate_machine(ComputeFormat("float32", "float32", shapes=((64, 64),)))
    assert cal.detail["contended"] == "the timings did not settle"
    assert cal.detail["conditions"]["stable"] is False
    assert cal_mod.load_calibration(cal.key).detail["contended"]  # cached, marked


def test_machine_calibration_end_to_end(tmp_path, monkeypatch):
    """The real probe (a file read cold in unit-sized ranges, a tensor per range; 128 MiB
    here instead of 512) and products in the format; cached under the format's key when
    quiet and settled."""
    from pyloader.residency import ComputeFormat, load_calibration
    from pyloader.residency import machine as calibration

    monkeypatch.setenv("PYLOADER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "MAX_UNIT_MIB", 32)
    monkeypatch.setattr(calibration, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(calibration, "conditions", lambda: dict(QUIET))
    fmt = ComputeFormat("bfloat16", "float32", bits=4, group_size=64,
                        shapes=((256, 128), (128, 256)), unit_bytes=1 << 20, unit_tensors=4)
    cal = calibration.calibrate_machine(fmt)
    assert cal.source == "machine" and fmt.key in cal.key
    assert cal.disk_bytes_per_s > 0 and cal.decode_s_per_byte > 0 and cal.unit_overhead_s > 0
    assert cal.detail["format"] == fmt.to_dict() and cal.detail["probe_bytes"] >= 1 << 20
    # The streaming bandwidth is fitted to an emulated pass of unit-sized reads.
    assert cal.detail["stream_units"] >= 2 and cal.detail["t_stream_pass_s"] > 0
    assert cal.detail["t_stream_warm_pass_s"] > 0
    assert 0 < cal.stream_bytes_per_s <= 1000 * cal.disk_bytes_per_s
    # pread streaming's own reads (direct, unit by unit), where the file system has them.
    from pyloader._native import core

    if core.platform()["portable_io"]:
        assert cal.direct_bytes_per_s is None
    else:
        assert cal.direct_bytes_per_s > 0
    if not cal.detail.get("contended"):
        assert load_calibration(cal.key).to_dict() == cal.to_dict()


# ----------------------------------------------------------------------------
# The resident set as text, and the messages for what is ambiguous (a bare 1 could mean
# all layers or one layer)


def test_resident_strings_and_their_messages():
    from pyloader.streaming import Residency, choose_resident

    sizes = [10] * 8
    assert choose_resident(sizes, "50%", "first_n") == {0, 1, 2, 3}
    assert choose_resident(sizes, "3layers", "first_n") == choose_resident(sizes, 3, "first_n")
    assert choose_resident(sizes, "layers=3", "last_n") == {5, 6, 7}
    assert choose_resident(sizes, "all", "first_n") == set(range(8))
    assert choose_resident(sizes, "none", "first_n") == set()
    assert choose_resident(sizes, "35B", "first_n", fixed_bytes=5) == {0, 1, 2}
    assert choose_resident(sizes, "0", "first_n") == set()  # none, whatever the unit
    for bare in ("3", " 35 ", "1"):  # layers or bytes? (the CLI's --resident 3 is layers)
        with pytest.raises(ValueError, match=rf"resident='{bare}' is ambiguous: .* write "
                                             rf"'{bare.strip()}layers' for .* "
                                             rf"'{bare.strip()}B' \(or '{bare.strip()}MB'\) "
                                             r"for a byte budget, or a fraction .* \(0.5\) "
                                             r"or a percentage \('50%'\)"):
            choose_resident(sizes, bare, "first_n")
    # The int 1 keeps one layer: said, since 1.0 keeps them all; "1layer" says it silently.
    with pytest.warns(pyloader.ResidencyWarning,
                      match=r"resident=1 \(the int\) keeps one layer of 8 .* every layer is "
                            r"resident=1.0 or 'all' \(pass '1layer'"):
        assert choose_resident(sizes, 1, "first_n") == {0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_resident(sizes, "1layer", "first_n") == {0}
        assert choose_resident([10], 1, "first_n") == {0}  # one layer is every layer
        assert choose_resident(sizes, 1.0, "first_n") == set(range(8))
    with pytest.raises(ValueError, match=r"resident=2.0 is a fraction .* pass the int 2 or "
                                         r"'2layers'"):
        choose_resident(sizes, 2.0, "first_n")
    with pytest.raises(ValueError, match=r"resident=40 is a layer count \(an int\), but the "
                                         r"model has 8 layers; a fraction is a float"):
        choose_resident(sizes, 40, "first_n")
    with pytest.raises(ValueError, match="write 1layer for one layer, or 100%"):
        Residency.from_text("1")  # the command line's reading of a bare 1
    with pytest.raises(ValueError, match="is not an amount: write a fraction"):
        choose_resident(sizes, "lots", "first_n")
    with pytest.warns(pyloader.ResidencyWarning,
                      match=r"^the weight budget of 4 B cannot be honoured"):
        assert choose_resident(sizes, "4B", "first_n", fixed_bytes=5) == set()


def test_load_model_refuses_a_bare_number_and_says_what_the_int_1_keeps(tmp_path):
    """load_model(resident="3") read a 3-byte budget (the CLI's --resident 3 is 3 layers):
    now refused, naming the forms; resident=1 (the int) keeps one layer and says so,
    from the caller's line; resident="auto" passes its budget on with its unit."""
    path = make_model_dir(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match=r"resident='3' is ambiguous: .*'3layers'.*'3B'"):
        pyloader.load_model(path, resident="3", tokenizer=False)
    with pytest.warns(pyloader.ResidencyWarning, match="keeps one layer") as caught:
        model, _ = pyloader.load_model(path, resident=1, tokenizer=False)
    assert caught[0].filename == __file__
    assert pyloader.stats(model)["resident_layers"] == [0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = pyloader.load_model(path, resident="1layer", tokenizer=False)
        assert pyloader.stats(model)["resident_layers"] == [0]
        model, _ = pyloader.load_model(path, resident="auto", tokenizer=False)
        assert pyloader.stats(model)["resident_layers"] == list(range(len(model.layers)))
