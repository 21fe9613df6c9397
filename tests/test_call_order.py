"""Prefetch follows the order a model calls its streamed units in, however many times per
forward it calls each: a custom module (not mlx-lm) whose blocks run out of list order,
one of them twice, streamed at resident 0 gives the resident model's outputs bit for bit,
and once its order is seen the units it calls were requested ahead of time."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import pyloader
from pyloader.streaming import StreamingController, StreamOptions, source_map
from pyloader.streaming.order import CallOrder
from pyloader.streaming.units import Unit

DIM = 64
N_BLOCKS = 5
#: Out of list order, block 0 twice per forward.
ORDER = (3, 0, 4, 0, 2, 1)
#: Another order (every block once, reversed pairs), for a model that changes its order.
OTHER = (1, 2, 0, 4, 3)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def __call__(self, x):
        return x + mx.tanh(self.proj(self.norm(x)))


class Shuffled(nn.Module):
    """Calls ``blocks`` in ``self.order`` (a tuple of indices, settable between calls)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = [Block() for _ in range(N_BLOCKS)]
        self.head = nn.Linear(DIM, DIM)
        self.order = ORDER

    def __call__(self, x):
        h = self.embed(x)
        for i in self.order:
            h = self.blocks[i](h)
        return self.head(h)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    mx.random.seed(43)
    model = Shuffled()
    path = tmp_path_factory.mktemp("order") / "model.safetensors"
    mx.save_safetensors(str(path), dict(tree_flatten(model.parameters())))
    return path


def resident(weights) -> Shuffled:
    model = Shuffled()
    model.load_weights(str(weights))
    return model


def streamed(weights, strategy: str, prefetch: int) -> tuple[Shuffled, StreamingController]:
    model = Shuffled()
    ckpt = pyloader.open(weights)
    sources = source_map(model, ckpt.tensors())
    ctl = StreamingController(ckpt, StreamOptions(strategy=strategy, prefetch=prefetch,
                                                  resident=0))
    ctl.attach(model, sources.direct, sources.compute_derived(model, ckpt))
    assert len(ctl.layout.units) == N_BLOCKS and not ctl.layout.resident
    return model, ctl


def inputs(k: int) -> mx.array:
    return mx.random.normal((2, 3, DIM), key=mx.random.key(k))


def hit_rate(before: dict, after: dict) -> float:
    hits = after["prefetch_hits"] - before["prefetch_hits"]
    misses = after["prefetch_misses"] - before["prefetch_misses"]
    return hits / (hits + misses)


def run(model, orders, start: int = 0) -> list[mx.array]:
    out = []
    for k, order in enumerate(orders, start):
        model.order = order
        y = model(inputs(k))
        mx.eval(y)
        out.append(y)
    return out


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_out_of_order_and_repeated_units(weights, strategy, prefetch):
    model, ctl = streamed(weights, strategy, prefetch)
    ref = run(resident(weights), [ORDER] * 8)
    got = run(model, [ORDER] * 2)  # the first pass learns the order
    warm = ctl.stats()
    got += run(model, [ORDER] * 6, 2)
    st = ctl.stats()
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got))
    assert st["passes"] == 8  # block 3, called first, starts each forward
    assert st["unit_calls"] == 8 * len(ORDER)
    assert st["prefetch_hits"] + st["prefetch_misses"] == st["unit_calls"]
    assert hit_rate(warm, st) == 1.0, st
    # Before the order was seen, list order was followed: it missed.
    assert warm["prefetch_misses"] > 2
    assert st["reads_in_flight"] <= prefetch
    ctl.close()


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_a_changed_order_is_learned(weights, strategy):
    orders = [ORDER] * 3 + [OTHER] * 5
    model, ctl = streamed(weights, strategy, 2)
    ref = run(resident(weights), orders)
    got = run(model, orders[:5])  # three of one order, two of the other
    before = ctl.stats()
    got += run(model, orders[5:], 5)
    after = ctl.stats()
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got))
    assert hit_rate(before, after) == 1.0, after
    # The change cost reads: requests made for the old order were withdrawn unused.
    assert before["prefetch_withdrawn"] > 0
    ctl.close()


class EncoderDecoder(Shuffled):
    """Blocks 0-1 run once per call (an encoder), blocks 2-4 once per step, ``steps``
    times (a decoder decoding ``steps`` tokens): Whisper's pattern in one list."""

    steps = 8

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks[:2]:
            h = block(h)
        out = []
        for _ in range(self.steps):
            for block in self.blocks[2:]:
                h = block(h)
            out.append(h)
        return self.head(mx.stack(out))


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_a_decoder_run_many_times_per_encoder_run(weights, strategy):
    ref = EncoderDecoder()
    ref.load_weights(str(weights))
    model = EncoderDecoder()
    ckpt = pyloader.open(weights)
    sources = source_map(model, ckpt.tensors())
    ctl = StreamingController(ckpt, StreamOptions(strategy=strategy, prefetch=1, resident=0))
    ctl.attach(model, sources.direct, sources.compute_derived(model, ckpt))
    want = [ref(inputs(k)) for k in range(5)]
    got = [model(inputs(k)) for k in range(2)]
    warm = ctl.stats()
    got += [model(inputs(k)) for k in range(2, 5)]
    st = ctl.stats()
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got))
    assert st["passes"] == 5 and st["unit_calls"] == 5 * (2 + 3 * EncoderDecoder.steps)
    # Per encoder run, two misses: the decoder's last block is followed by its first
    # block for every step but the last (list order misses those seven, 0.73).
    assert hit_rate(warm, st) == pytest.approx(1 - 2 / (2 + 3 * EncoderDecoder.steps))
    ctl.close()


def test_a_resident_model_is_freed_when_dropped(weights):
    """The controller's parts hold no reference cycle: with every block resident (no
    hook on any module) dropping the model frees its arrays at once, not at the next
    garbage collection (a load after it would count them in its peak)."""
    model = Shuffled()
    ckpt = pyloader.open(weights)
    sources = source_map(model, ckpt.tensors())
    ctl = StreamingController(ckpt, StreamOptions(resident=1.0))
    ctl.attach(model, sources.direct, sources.compute_derived(model, ckpt))
    assert not ctl.layout.units
    held = [ctl, ctl.layer_units, ctl.layer_units.strays, ctl.layer_units.order,
            ctl.recorder, ctl.expert_caches, model.blocks[0]]
    refs = [weakref.ref(x) for x in held]
    gc.disable()
    try:
        del model, ctl, held
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()


def units(n: int) -> list[Unit]:
    out = [Unit(name=f"b{i}", module=None, layer=i, sources={}) for i in range(n)]
    for k, u in enumerate(out):
        u.order = k
    return out


def test_list_order_until_a_call_is_seen():
    u = units(4)
    order = CallOrder()
    order.restart(u)
    assert order.observe(u[1])  # the first call begins a pass
    assert order.predict(2) == [u[2], u[3]]
    assert order.predict(3, skip=u[2]) == [u[3], u[0], u[1]]
    assert order.predict(0) == []


def test_the_longest_context_tells_repeated_units_apart():
    u = units(3)
    order = CallOrder()
    order.restart(u)
    calls = [u[0], u[1], u[0], u[2]] * 2
    passes = [order.observe(x) for x in calls]
    assert sum(passes) == 4  # a pass begins at every call of the first unit called
    # After "0 2" comes 0, then 1 (after "2 0"), not 2 (after "1 0").
    assert order.predict(3) == [u[0], u[1], u[2]]
    order.observe(u[0])
    assert order.predict(1) == [u[1]]
    order.observe(u[1])
    assert order.predict(2) == [u[0], u[2]]


def test_restart_forgets_the_units_that_left():
    u = units(3)
    order = CallOrder()
    order.restart(u)
    for x in [u[2], u[1], u[0]] * 2:
        order.observe(x)
    assert order.predict(1) == [u[2]]
    order.restart([u[0], u[1]])
    u[0].order, u[1].order = 0, 1
    assert all(u[2] not in k and v is not u[2] for k, v in order.successors.items())
    assert order.predict(2) == [u[1], u[0]]  # the learned step, then list order
    assert order.head is None and order.observe(u[1])
