"""``load_model``'s signature: keyword-only, mlx-lm's own arguments by name with its
defaults, streaming settings in one typed ``StreamOptions``, and the resident set parsed
once into a ``Residency``.

The refusals need no model: they are raised before any file is opened."""

from __future__ import annotations

import inspect

import mlx.core as mx
import pytest
from models import make_model_dir

import pyloader
from pyloader import Distribution, Residency, StreamOptions


def test_load_model_takes_every_argument_by_name():
    params = inspect.signature(pyloader.load_model).parameters
    # Only the path is positional: nothing after it can be read in mlx_lm.load's order.
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [p.name for p in positional] == ["path_or_hf_repo"]
    assert not [p for p in params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_load_model_names_every_mlx_lm_load_argument_with_its_default():
    """Fails when mlx-lm adds an argument to ``mlx_lm.load``: name it here too."""
    mlx_lm = pytest.importorskip("mlx_lm")
    ours = inspect.signature(pyloader.load_model).parameters
    for name, theirs in inspect.signature(mlx_lm.load).parameters.items():
        assert name in ours, f"mlx_lm.load takes {name}; load_model does not"
        assert ours[name].default == theirs.default, name


@pytest.mark.parametrize("args", [
    ({"eos_token": "</s>"},),                  # mlx_lm.load(path, tokenizer_config)
    (None, {"vocab_size": 8}),                 # ... model_config
    (0.5,),                                    # a resident set given by position
], ids=["tokenizer_config", "model_config", "resident"])
def test_a_positional_call_in_mlx_lm_load_order_fails_loudly(tmp_path, args):
    with pytest.raises(TypeError, match="positional argument"):
        pyloader.load_model(tmp_path / "nowhere", *args)


def test_unknown_keyword_is_named(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'tokenizer_confg'"):
        pyloader.load_model(tmp_path / "nowhere", tokenizer_confg={})


def test_streaming_and_sharding_settings_are_not_keywords(tmp_path):
    """They go in ``options=StreamOptions(...)`` and ``group=Distribution(...)``."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'strategy'"):
        pyloader.load_model(tmp_path / "nowhere", strategy="pread")
    with pytest.raises(TypeError, match="unexpected keyword argument 'shard'"):
        pyloader.load_model(tmp_path / "nowhere", shard="tensor")


def test_engine_names_are_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown engine 'vllm'"):
        pyloader.load_model(tmp_path / "nowhere", engine="vllm")
    with pytest.raises(TypeError, match="options must be a StreamOptions"):
        pyloader.load_model(tmp_path / "nowhere", options={"strategy": "pread"})


def test_resident_and_options_combine_or_refuse(tmp_path):
    path = make_model_dir(tmp_path / "m", "llama")  # 2 layers
    model, _ = pyloader.load_model(path, resident=0, tokenizer=False, engine="mlx_lm",
                                   options=StreamOptions(strategy="pread"))
    st = pyloader.stats(model)
    assert st["resident_layers"] == [] and st["strategy"] == "pread"
    model, _ = pyloader.load_model(path, tokenizer=False,
                                   options=StreamOptions(resident="1layer"))
    assert pyloader.stats(model)["resident_layers"] == [0]
    # The same set in both places is one setting; two different ones are refused.
    pyloader.load_model(path, resident=0.0, tokenizer=False,
                        options=StreamOptions(resident="none"))
    with pytest.raises(ValueError, match=r"resident=0\.5 and options\.resident=1layers "
                                         "disagree"):
        pyloader.load_model(path, resident=0.5, options=StreamOptions(resident="1layer"))
    # mlx-lm's own arguments pass through by name.
    model, tok, config = pyloader.load_model(path, return_config=True, tokenizer=False,
                                             lazy=True)
    assert tok is None and config["model_type"] == "llama"
    with pytest.raises(ValueError, match="one value per rank.*pass group="):
        pyloader.load_model(path, resident=[0.5, 1.0])
    with pytest.raises(ValueError, match="mlx-lm model: engine_args apply to other engines"):
        pyloader.load_model(path, engine_args={"dtype": mx.float16})


def test_residency_is_parsed_once_into_a_typed_value():
    assert StreamOptions(resident="50%").resident == Residency("fraction", 0.5)
    assert StreamOptions(resident="4layers").resident == Residency("count", 4)
    assert StreamOptions(resident="600MB").resident == Residency("bytes", 600_000_000)
    assert StreamOptions(resident={3, 1}).resident == Residency("layers", frozenset({1, 3}))
    assert StreamOptions(resident="auto").resident.is_auto
    assert StreamOptions().resident.keeps_all and StreamOptions(resident="all").resident.keeps_all
    assert StreamOptions(resident=1).resident.bare_one
    assert not StreamOptions(resident="1layer").resident.bare_one
    per_rank = StreamOptions(resident=["2GB", 0.5]).resident
    assert per_rank.kind == "per_rank"
    assert per_rank.for_rank(0, 2) == Residency.of_bytes(2 * 10**9)
    with pytest.raises(ValueError, match="2 per-rank values for a group of 3"):
        per_rank.for_rank(0, 3)
    # Parsing a parsed value is the identity, so with_() and nested options never re-read.
    r = Residency.parse("25%")
    assert Residency.parse(r) is r and StreamOptions(resident=r).resident is r
    # The command line's reading: a bare integer of 2 or more is a count.
    assert Residency.from_text("3") == Residency("count", 3)
    with pytest.raises(ValueError, match="resident='3' is ambiguous"):
        StreamOptions(resident="3")
    with pytest.raises(ValueError, match="fraction of the layers .* must be in"):
        StreamOptions(resident=1.5)
    with pytest.raises(TypeError, match="not a bool"):
        StreamOptions(resident=True)
    with pytest.raises(ValueError, match="not a valid fraction"):
        Residency("fraction", 2.0)


def test_distribution_checks_its_settings_when_built():
    group = mx.distributed.init()
    assert Distribution.of(group) == Distribution(group)
    assert Distribution.of(None) is None
    d = Distribution(group, shard="tensor")
    assert Distribution.of(d) is d
    with pytest.raises(ValueError, match="unknown shard mode 'both'"):
        Distribution(group, shard="both")
    with pytest.raises(ValueError, match="split= is a pipeline setting"):
        Distribution(group, shard="tensor", split=[2])


def _gguf(path):
    from gguf_files import tiny_llama_gguf

    return tiny_llama_gguf(path, {})


@pytest.mark.parametrize("call, on_file", [
    (lambda p: pyloader.load_model(p), False),
    (lambda p: pyloader.load_model(p, kernels="mlx", tokenizer=False, strict=False), False),
    (lambda p: pyloader.open(p), False),
    (lambda p: pyloader.load(p), False),
    (lambda p: pyloader.Checkpoint(p), True),
], ids=["load_model", "load_model-not-strict", "open", "load", "Checkpoint"])
def test_a_directory_whose_weights_are_a_gguf_file_names_it(tmp_path, call, on_file):
    """A directory whose only weights are a GGUF file, or a GGUF file where only safetensors
    belong (``Checkpoint``): a typed error naming the file and the calls that read it."""
    directory = tmp_path / "model"
    directory.mkdir()
    gguf = _gguf(directory / "model.gguf")
    given = gguf if on_file else directory
    with pytest.raises(pyloader.GGUFFileError) as info:
        call(given)
    text = str(info.value)
    assert isinstance(info.value, pyloader.FormatError)
    assert text.startswith(f"{given}: ") and "GGUF file" in text
    assert f"pyloader convert-gguf {gguf} OUT_DIR" in text and f"load of {gguf}" in text


@pytest.mark.parametrize("name", ["model.gguf", "model.safetensors"])
def test_a_gguf_file_loads_in_place(tmp_path, name):
    """The file itself (named for what it is or not): load_model, open and load read it."""
    gguf = _gguf(tmp_path / "model.gguf").rename(tmp_path / name)
    model, tok = pyloader.load_model(gguf, kernels="mlx")
    assert tok is not None and len(model.model.layers) == 2
    assert "model.layers.1.mlp.up_proj.weight" in pyloader.open(gguf)
    assert pyloader.load(gguf)["model.norm.weight"].dtype == mx.float32
    with pytest.raises(pyloader.GGUFFileError, match="GGUF file"):
        pyloader.Checkpoint(gguf)


def test_a_directory_with_safetensors_and_a_gguf_file_loads_the_safetensors(tmp_path):
    path = make_model_dir(tmp_path / "m", "llama", dtype=mx.float16)
    _gguf(path / "original.gguf")
    model, _ = pyloader.load_model(path, kernels="mlx", tokenizer=False)
    assert len(pyloader.open(path)) > 0 and model.model.layers
