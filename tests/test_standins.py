"""A streamed parameter is never computed with while its unit is out (its stand-in would
give wrong results silently).

Models whose forward reaches a layer's weights other than through the layer's own call
(the call pyloader's per-unit hook wraps): calling the layer's submodules directly, reading
a layer's ``.weight`` in the model's own code, running the layers twice per forward, and
mlx-lm's ``iquestloopcoder`` (which does the first and the third). At resident 0 each gives
plain mlx-lm's greedy tokens, or raises ``pyloader.StandInError`` before a token is
returned — never other tokens. Before stand-ins could not be computed with, the first,
second and fourth gave wrong tokens (zeros in place of the streamed weights) without error.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import iquestloopcoder, llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model as mlx_lm_load_model
from models import ARCHS, make_model_dir

import pyloader
from pyloader.streaming import controller_of

PROMPT = [1, 7, 42, 9, 100, 3, 250, 17]
N_TOKENS = 6


class SubmoduleModel(llama.LlamaModel):
    """Calls each layer's norms, attention and MLP itself: never ``layer(...)``."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = h + layer.self_attn(layer.input_layernorm(h), mask, c)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


class WeightReadModel(llama.LlamaModel):
    """Calls its layers, and also reads each layer's MLP weight in its own code."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
            h = h + 4.0 * layer.mlp.down_proj.weight[:, 0].astype(h.dtype)
        return self.norm(h)


class TwiceModel(llama.LlamaModel):
    """Runs every layer twice per forward (a cache per layer per round)."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.embed_tokens(inputs)
        n = len(self.layers)
        cache = cache if cache is not None else [None] * (2 * n)
        mask = create_attention_mask(h, cache[0])
        for r in range(2):
            for layer, c in zip(self.layers, cache[r * n:(r + 1) * n]):
                h = layer(h, mask, c)
        return self.norm(h)


def _model_class(inner_cls, caches_per_layer: int = 1):
    class Model(llama.Model):
        def __init__(self, args):
            super().__init__(args)
            self.model = inner_cls(args)

        def make_cache(self):
            return [KVCache() for _ in range(caches_per_layer * len(self.layers))]

    return Model


FORWARDS = {
    "submodules": (_model_class(SubmoduleModel), llama.ModelArgs),
    "weight_read": (_model_class(WeightReadModel), llama.ModelArgs),
    "twice": (_model_class(TwiceModel, 2), llama.ModelArgs),
    "iquestloopcoder": (iquestloopcoder.Model, iquestloopcoder.ModelArgs),
}
ARCHS.setdefault("iquestloopcoder", {"model_type": "iquestloopcoder", "head_dim": 16,
                                     "num_hidden_layers": 3, "loop_window_size": 4})


def _tokens(model) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS)]


@pytest.fixture(scope="module", params=sorted(FORWARDS))
def case(request, tmp_path_factory):
    name = request.param
    classes = FORWARDS[name]
    arch = "iquestloopcoder" if name == "iquestloopcoder" else "llama"
    path = make_model_dir(tmp_path_factory.mktemp(name) / "m", arch, dtype=mx.float32,
                          num_hidden_layers=3)
    getter = lambda config: classes  # noqa: E731 - mlx-lm's get_model_classes
    ref, _ = mlx_lm_load_model(path, get_model_classes=getter)
    return name, path, getter, _tokens(ref)


@pytest.mark.parametrize("granularity", ["layer", "sublayer"])
@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_streamed_forward_gives_mlx_lm_tokens_or_raises(case, strategy, granularity):
    name, path, getter, ref = case
    model, _ = pyloader.load_model(
        path, resident=0, tokenizer=False, get_model_classes=getter,
        options=pyloader.StreamOptions(strategy=strategy, granularity=granularity))
    if name == "weight_read":
        # The model's own code reads a streamed weight after its layer ran: no call
        # brings it in, so the stand-in raises (its message names the weight).
        with pytest.raises(pyloader.StandInError,
                           match=r"model\.layers\.0\.mlp\.down_proj\.weight .*resident=1\.0"):
            _tokens(model)
        return
    assert _tokens(model) == ref
    st = pyloader.stats(model)
    assert st["passes"] > 0 and st["bytes_read"] > 0
    stray = sum(u["stray_entries"] for u in st["units"].values())
    if name == "twice":
        assert stray == 0  # every unit came in through its own call
    elif not (name == "submodules" and granularity == "sublayer"):
        assert stray > 0   # brought in by the modules holding their weights


def test_weight_read_served_when_resident(tmp_path):
    getter = lambda config: FORWARDS["weight_read"]  # noqa: E731
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.float32, num_hidden_layers=3)
    ref, _ = mlx_lm_load_model(path, get_model_classes=getter)
    model, _ = pyloader.load_model(path, resident=1.0, tokenizer=False,
                                   get_model_classes=getter)
    assert _tokens(model) == _tokens(ref)


def test_holders_are_unguarded_while_their_unit_runs(tmp_path):
    """The guard hooks sit on a streamed unit's holders only while it is out: a unit
    called the usual way runs its Linear and norm modules with their own classes."""
    path = make_model_dir(tmp_path / "m", "llama", num_hidden_layers=2)
    model, _ = pyloader.load_model(path, resident=0, tokenizer=False,
                                   options=pyloader.StreamOptions(strategy="pread"))
    layer = model.layers[0]
    seen = []
    q_proj = layer.self_attn.q_proj
    assert type(q_proj).__name__.startswith("Hooked")  # out: guarded
    original = type(layer).__mro__[1].__call__

    def spy(self, *a, **k):
        seen.append(type(self.self_attn.q_proj).__name__)
        return original(self, *a, **k)

    type(layer).__mro__[1].__call__ = spy
    try:
        _tokens(model)
    finally:
        type(layer).__mro__[1].__call__ = original
    assert seen and all(n == "Linear" for n in seen)
    st = pyloader.stats(model)
    assert sum(u["stray_entries"] for u in st["units"].values()) == 0
    assert type(q_proj).__name__.startswith("Hooked")  # out again after the pass
    assert controller_of(model).in_memory(model)


def test_stand_in_reads_as_the_parameter_and_raises_when_evaluated():
    from pyloader.streaming import placeholder

    a = placeholder((4, 8), mx.bfloat16, "the message")
    assert a.shape == (4, 8) and a.dtype == mx.bfloat16 and a.nbytes == 64
    y = mx.ones((2, 8), dtype=mx.bfloat16) @ a.T
    for evaluate in (lambda: mx.eval(y), lambda: y.tolist(), lambda: mx.async_eval(y + 1)):
        with pytest.raises(pyloader.StandInError, match="the message"):
            evaluate()
    assert mx.ones((3,)).sum().item() == 3.0  # MLX is usable after the error
    # From another thread too (MLX's default streams are per thread: a stand-in made
    # while loading is read by a generating thread).
    import threading

    seen = []

    def other():
        try:
            mx.eval(mx.ones((2, 8), dtype=mx.bfloat16) @ a.T)
        except Exception as e:  # noqa: BLE001 - its type is the point
            seen.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(seen) == 1 and isinstance(seen[0], pyloader.StandInError), seen


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
def test_two_threads_on_a_model_served_through_its_holders(case, strategy):
    """Two threads generating at once on a streamed model whose units come in through
    their holders (and the others) give the single-threaded tokens or the same error."""
    import threading

    name, path, getter, ref = case
    model, _ = pyloader.load_model(path, resident=0, tokenizer=False, get_model_classes=getter,
                                   options=pyloader.StreamOptions(strategy=strategy))
    out: list = [None, None]
    barrier = threading.Barrier(2)

    def run(i):
        barrier.wait()
        try:
            out[i] = _tokens(model)
        except Exception as e:  # noqa: BLE001 - compared below
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if name == "weight_read":
        assert all(isinstance(o, pyloader.StandInError) for o in out)
    else:
        assert out == [ref, ref]
