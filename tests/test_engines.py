"""Models of other engines (mlx-vlm, mlx-whisper, mlx-embeddings) loaded by pyloader.

Each engine builds a small random-weight model with its own classes (fixed seeds) and
saves it in its own format; ``pyloader.load_model`` (``engine="auto"``) must return what
the engine's own loader returns, with outputs bit-identical to the engine's own load, at
resident 0, 0.5 and 1 with mmap and pread. Also: which blocks stream (``units``), the
public steps (``pyloader.stream``) on each engine's model, and the errors (an engine not
installed, a pattern that matches nothing, a vision model never loaded text-only).

A test skips only when its engine is not installed (``pip install ".[test]"`` installs
them all).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import pyloader
from pyloader import StreamOptions, engines
from pyloader.streaming import select_units

RESIDENTS = [0.0, 0.5, 1.0]
STRATEGIES = ["mmap", "pread"]


def need(module: str):
    """The engine's module, or a skip saying it is not installed."""
    pkg = module.split(".")[0]
    return pytest.importorskip(
        module, reason=f"{pkg.replace('_', '-')} is not installed (pip install '.[test]')")


def outputs(result) -> list[mx.array]:
    """Every array a forward pass returned (an array, a tuple, or an output dataclass)."""
    if isinstance(result, mx.array):
        return [result]
    if isinstance(result, (list, tuple)):
        return [a for r in result for a in outputs(r)]
    if hasattr(result, "__dict__"):
        return [a for v in vars(result).values() for a in outputs(v)]
    return []


def same(a, b) -> bool:
    xs, ys = outputs(a), outputs(b)
    return len(xs) == len(ys) > 0 and all(
        x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()
        for x, y in zip(xs, ys))


# --------------------------------------------------------------------------------------
# The engines' models, saved as each engine saves them

WHISPER_DIMS = dict(n_mels=80, n_audio_ctx=16, n_audio_state=64, n_audio_head=2,
                    n_audio_layer=2, n_vocab=96, n_text_ctx=8, n_text_state=64,
                    n_text_head=2, n_text_layer=3)


def save_whisper(d: Path, quantization: dict | None = None) -> Path:
    """As mlx-whisper's converter writes a model: weights.safetensors + config.json."""
    whisper = need("mlx_whisper.whisper")
    mx.random.seed(0)
    model = whisper.Whisper(whisper.ModelDimensions(**WHISPER_DIMS), mx.float32)
    config = {**WHISPER_DIMS, "model_type": "whisper"}
    if quantization:
        nn.quantize(model, **quantization,
                    class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding)))
        config["quantization"] = quantization
    d.mkdir()
    mx.save_safetensors(str(d / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(config))
    return d


LLAVA = {
    "model_type": "llava", "image_token_index": 250, "vocab_size": 256,
    "text_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                    "intermediate_size": 128, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32,
                      "num_hidden_layers": 3, "intermediate_size": 64,
                      "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                      "projection_dim": 32},
}
PALIGEMMA = {
    "model_type": "paligemma", "image_token_index": 250, "vocab_size": 256,
    "hidden_size": 64, "projection_dim": 64,
    "text_config": {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2,
                    "intermediate_size": 128, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 256},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                      "num_hidden_layers": 2, "intermediate_size": 64,
                      "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                      "projection_dim": 64},
}

_SMALL_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
               "rms_norm_eps": 1e-5}
QWEN2_VL = {  # its text settings live at the top level
    "model_type": "qwen2_vl", "image_token_id": 250, "video_token_id": 251,
    "vision_start_token_id": 252, **_SMALL_TEXT,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
    "text_config": {"model_type": "qwen2_vl", **_SMALL_TEXT,
                    "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}},
    "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32,
                      "hidden_size": 64, "num_heads": 2, "patch_size": 14},
}
IDEFICS3 = {
    "model_type": "idefics3", "vocab_size": 256, "image_token_id": 250, "scale_factor": 2,
    "text_config": {"model_type": "llama", **_SMALL_TEXT},
    "vision_config": {"model_type": "idefics3", "hidden_size": 32, "num_hidden_layers": 2,
                      "intermediate_size": 64, "num_attention_heads": 2, "image_size": 28,
                      "patch_size": 14},
}


def save_vlm(d: Path, config: dict) -> Path:
    """As mlx-vlm saves a model: its save_weights (shards + index) and save_config."""
    vu = need("mlx_vlm.utils")
    mx.random.seed(0)
    arch, _ = vu.get_model_and_args(config)
    cfg = json.loads(json.dumps(config))
    model_config = vu.update_module_configs(arch.ModelConfig.from_dict(cfg), arch, cfg,
                                            ["text", "vision", "perceiver", "projector",
                                             "audio"])
    vu.save_weights(d, arch.Model(model_config))
    vu.save_config(json.loads(json.dumps(config)), d / "config.json")
    return d


BERT = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 32,
        "num_hidden_layers": 3, "intermediate_size": 64, "num_attention_heads": 2,
        "max_position_embeddings": 64, "vocab_size": 40}
MODERNBERT = {"model_type": "modernbert", "architectures": ["ModernBertModel"],
              "hidden_size": 32, "num_hidden_layers": 3, "intermediate_size": 64,
              "num_attention_heads": 2, "max_position_embeddings": 64, "vocab_size": 40,
              "global_attn_every_n_layers": 2, "local_attention": 8}
QWEN3_EMBEDDING = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2,
                   "intermediate_size": 64, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64,
                   "vocab_size": 40, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "tie_word_embeddings": True}
XLM_ROBERTA = {"model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"],
               "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
               "num_attention_heads": 2, "max_position_embeddings": 64, "vocab_size": 40}


def save_embeddings(d: Path, config: dict, tokenizer: bool = False) -> Path:
    """As mlx-embeddings saves a model: its save_weights and config.json (with a BERT
    WordPiece tokenizer when asked)."""
    utils = need("mlx_embeddings.utils")
    mx.random.seed(0)
    model_cls, args_cls, _, _ = utils._get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    utils.save_weights(d, dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer:
        from transformers import BertTokenizerFast

        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat"]
        (d / "vocab.txt").write_text("\n".join(words) + "\n")
        BertTokenizerFast(vocab_file=str(d / "vocab.txt")).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Model directories by name, built on first use."""
    made: dict[str, Path] = {}
    makers = {
        "whisper": lambda d: save_whisper(d),
        "whisper_q4": lambda d: save_whisper(d, {"group_size": 32, "bits": 4}),
        "llava": lambda d: save_vlm(d, LLAVA),
        "paligemma": lambda d: save_vlm(d, PALIGEMMA),
        "bert": lambda d: save_embeddings(d, BERT, tokenizer=True),
        "xlm_roberta": lambda d: save_embeddings(d, XLM_ROBERTA),
        "qwen2_vl": lambda d: save_vlm(d, QWEN2_VL),
        "idefics3": lambda d: save_vlm(d, IDEFICS3),
        "modernbert": lambda d: save_embeddings(d, MODERNBERT),
        "qwen3_embedding": lambda d: save_embeddings(d, QWEN3_EMBEDDING),
    }

    def get(name: str) -> Path:
        if name not in made:
            made[name] = makers[name](tmp_path_factory.mktemp(name) / "model")
        return made[name]

    return get


# What each directory's engine loads, and one forward pass of it.

def engine_load(name: str, path: Path):
    if name.startswith("whisper"):
        return need("mlx_whisper.load_models").load_model(str(path))
    if ENGINE_OF[name] == "mlx_vlm":
        return need("mlx_vlm.utils").load_model(path)
    return need("mlx_embeddings.utils").load_model(path, path_to_repo=str(path))


def model_of(name: str, result):
    return result if name.startswith("whisper") else result[0]


def forward(name: str, model):
    mx.random.seed(1)
    if name.startswith("whisper"):
        mel = mx.random.normal((1, 2 * WHISPER_DIMS["n_audio_ctx"], WHISPER_DIMS["n_mels"]))
        return model(mel, mx.array([[1, 2, 3, 4]]))
    if name in ("llava", "paligemma"):
        pixels = mx.random.normal((1, 3, 28, 28))
        ids = mx.array([[1] + [250] * 4 + [5, 7, 9]])  # 4 patches: 4 image tokens
        return model(ids, pixels, mx.ones(ids.shape) if name == "paligemma" else None)
    if ENGINE_OF[name] == "mlx_vlm":  # text only: the language model's layers
        return model(mx.array([[1, 5, 7, 9]]), None, None)
    return model(mx.array([[2, 5, 6, 7, 3]]))


ENGINE_OF = {"whisper": "mlx_whisper", "whisper_q4": "mlx_whisper", "llava": "mlx_vlm",
             "paligemma": "mlx_vlm", "bert": "mlx_embeddings",
             "xlm_roberta": "mlx_embeddings", "qwen2_vl": "mlx_vlm", "idefics3": "mlx_vlm",
             "modernbert": "mlx_embeddings", "qwen3_embedding": "mlx_embeddings"}


@pytest.mark.parametrize("name", ["whisper", "llava", "bert"])
@pytest.mark.parametrize("resident", RESIDENTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_model_is_the_engines_model_bit_for_bit(dirs, name, resident, strategy):
    path = dirs(name)
    want = engine_load(name, path)
    got = pyloader.load_model(path, resident=resident,
                              options=StreamOptions(strategy=strategy))
    model = model_of(name, got)
    assert type(model) is type(want)
    assert same(forward(name, model), forward(name, want))
    st = pyloader.stats(model)
    n_units = len(select_units(want, engines.block_patterns(want)))
    assert len(st["units"]) == n_units - len(st["resident_layers"])
    if resident == 0.0:
        assert st["resident_layers"] == [] and st["bytes_read"] > 0
    if resident == 1.0:
        assert st["units"] == {}


@pytest.mark.parametrize("name", ["whisper_q4", "paligemma", "qwen2_vl", "idefics3",
                                  "xlm_roberta", "modernbert"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_other_architectures_stream_bit_for_bit(dirs, name, strategy):
    path = dirs(name)
    assert engines.detect(path) == ENGINE_OF[name]
    want = engine_load(name, path)
    model = model_of(name, pyloader.load_model(path, resident=0.5,
                                               options=StreamOptions(strategy=strategy)))
    assert type(model) is type(want)
    assert pyloader.stats(model)["units"]  # something streams
    assert same(forward(name, model), forward(name, want))


@pytest.mark.parametrize("name", ["whisper", "llava", "bert"])
def test_detect_names_the_engine(dirs, name):
    assert engines.detect(dirs(name)) == ENGINE_OF[name]


def test_a_type_mlx_lm_also_serves_needs_the_engine_named(dirs):
    """A Qwen3 embedding model is a Qwen3 to mlx-lm: auto gives mlx-lm's model, and
    engine="mlx_embeddings" the engine's, bit-identical to its own load."""
    path = dirs("qwen3_embedding")
    assert engines.detect(path) == "mlx_lm"
    model, _ = pyloader.load_model(path, resident=0.5, engine="mlx_embeddings")
    want = engine_load("qwen3_embedding", path)
    assert type(model) is type(want) and pyloader.stats(model)["units"]
    assert same(forward("qwen3_embedding", model), forward("qwen3_embedding", want))


def test_returns_what_the_engine_returns(dirs):
    """mlx-embeddings: (model, tokenizer), the tokenizer as its load builds it; mlx-vlm
    without processor files: (model, None); mlx-whisper: the model alone."""
    utils = need("mlx_embeddings.utils")
    path = dirs("bert")
    _, want_tok = utils.load(str(path))
    model, tok = pyloader.load_model(path, resident=0.5)
    assert type(tok) is type(want_tok)
    assert tok.encode("the cat sat") == want_tok.encode("the cat sat")
    assert pyloader.load_model(path, tokenizer=False)[1] is None
    _, proc = pyloader.load_model(dirs("llava"))
    assert proc is None
    assert isinstance(pyloader.load_model(dirs("whisper")), nn.Module)


def test_vlm_returns_the_engines_processor(tmp_path):
    """With processor files, (model, processor) as mlx_vlm.load returns them: the
    architecture's processor, its image processor, a detokenizer."""
    vlm = need("mlx_vlm")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    path = save_vlm(tmp_path / "llava", LLAVA)
    words = ["<unk>", "<s>", "</s>", "the", "cat"] + [f"t{i}" for i in range(245)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["<image>"])},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  bos_token="<s>", eos_token="</s>")
    LlavaProcessor(image_processor=CLIPImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tok, patch_size=14, image_token="<image>",
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    ).save_pretrained(path)
    _, want = vlm.load(str(path))
    _, proc = pyloader.load_model(path, resident=0.5)
    assert type(proc) is type(want) and proc is not None
    assert type(proc.image_processor) is type(want.image_processor)
    assert type(proc.detokenizer) is type(want.detokenizer)
    assert proc.tokenizer("the cat")["input_ids"] == want.tokenizer("the cat")["input_ids"]


def test_engine_args_reach_the_engines_loader(dirs):
    """mlx-whisper's ``dtype`` (what its model computes in; the weights keep the file's):
    the model as its own loader builds it, streamed, bit for bit; an argument only
    mlx-lm models take is refused."""
    path = dirs("whisper")
    want = need("mlx_whisper.load_models").load_model(str(path), dtype=mx.float16)
    model = pyloader.load_model(path, resident=0.5, engine_args={"dtype": mx.float16})
    assert pyloader.stats(model)["units"]
    assert model.encoder._positional_embedding.dtype == mx.float16
    assert same(forward("whisper", model), forward("whisper", want))
    with pytest.raises(ValueError, match="mlx_whisper model: adapter_path apply to mlx-lm"):
        pyloader.load_model(path, adapter_path="adapters")


def test_whisper_encoder_streams_when_named(dirs):
    """units= chooses the streamed blocks: the encoder alone, or decoder first so that
    the first 3 layers kept resident are the decoder's (it runs for every token)."""
    path = dirs("whisper")
    want = forward("whisper", engine_load("whisper", path))
    model = engines.load(path, options=StreamOptions(resident=0.0,
                                                     units="encoder.blocks.*"))
    assert sorted(pyloader.stats(model)["units"]) == ["encoder.blocks.0", "encoder.blocks.1"]
    assert same(forward("whisper", model), want)
    model = engines.load(path, options=StreamOptions(
        resident=WHISPER_DIMS["n_text_layer"], units=["decoder.blocks.*", "encoder.blocks.*"]))
    units = pyloader.stats(model)["units"]
    assert all(u.startswith("encoder.") for u in units) and len(units) == 2
    assert same(forward("whisper", model), want)
    # the default: every block list, encoder first (the model's order)
    model = engines.load(path, options=StreamOptions(resident=0.0))
    assert len(pyloader.stats(model)["units"]) == 5
    assert list(pyloader.stats(model)["units"])[:2] == ["encoder.blocks.0", "encoder.blocks.1"]


def spy_builds(monkeypatch) -> list[bool]:
    """``shapes_only`` of every load capture pyloader.engines makes from now on."""
    made: list[bool] = []
    real = engines.LoadCapture

    class Spy(real):
        def __init__(self, ckpt, *, shapes_only=False):
            made.append(shapes_only)
            super().__init__(ckpt, shapes_only=shapes_only)

    monkeypatch.setattr(engines, "LoadCapture", Spy)
    return made


def test_whisper_is_built_without_reading_its_weights(dirs, monkeypatch):
    """mlx-whisper's loader evaluates every parameter: it gets shape-only arrays, once."""
    made = spy_builds(monkeypatch)
    model = pyloader.load_model(dirs("whisper"), resident=0.0)
    assert made == [True]
    assert same(forward("whisper", model),
                forward("whisper", engine_load("whisper", dirs("whisper"))))


def test_a_parameter_the_loader_does_not_read_is_built_again_from_real_loads(
        dirs, tmp_path, monkeypatch):
    """A checkpoint without decoder.ln.bias: mlx-whisper keeps the model's own value
    (its update is not strict), which a shapes-only build cannot tell from a computed
    one: the build runs again with real loads, and the model is still the engine's."""
    path = tmp_path / "partial"
    path.mkdir()
    (path / "config.json").write_text((dirs("whisper") / "config.json").read_text())
    weights = mx.load(str(dirs("whisper") / "weights.safetensors"))
    del weights["decoder.ln.bias"]
    mx.save_safetensors(str(path / "weights.safetensors"), weights)
    made = spy_builds(monkeypatch)
    model = pyloader.load_model(path, resident=0.5)
    assert made == [True, False]
    assert same(forward("whisper", model), forward("whisper", engine_load("whisper", path)))


def test_capture_hands_out_shapes_only_arrays(dirs):
    path = dirs("whisper")
    ckpt = pyloader.open(path)
    original = mx.load
    with engines.LoadCapture(ckpt, shapes_only=True) as cap:
        arrays = mx.load(str(path / "weights.safetensors"))
    real = mx.load(str(path / "weights.safetensors"))
    assert {cap.direct[id(a)].name for a in arrays.values()} == set(real)
    w = arrays["decoder.token_embedding.weight"]
    assert w.shape == real["decoder.token_embedding.weight"].shape
    assert not mx.any(w).item() and mx.any(real["decoder.token_embedding.weight"]).item()
    assert mx.load is original  # restored


# --------------------------------------------------------------------------------------
# The public steps on each engine's model

def test_stream_whisper_built_by_hand(dirs):
    whisper = need("mlx_whisper.whisper")
    path = dirs("whisper")
    model = whisper.Whisper(whisper.ModelDimensions(**WHISPER_DIMS), mx.float32)
    ctrl = pyloader.stream(model, path, StreamOptions(resident=0.5,
                                                      units=["encoder.blocks.*",
                                                             "decoder.blocks.*"]))
    assert ctrl.stats()["resident_layers"] == [0, 1]
    assert same(forward("whisper", model), forward("whisper", engine_load("whisper", path)))


def test_stream_with_a_ready_tensor_map(dirs):
    whisper = need("mlx_whisper.whisper")
    path = dirs("whisper")
    ckpt = pyloader.open(path)
    model = whisper.Whisper(whisper.ModelDimensions(**WHISPER_DIMS), mx.float32)
    tensors = {p: ckpt[p] for p, _ in tree_flatten(model.parameters())}
    pyloader.stream(model, ckpt, StreamOptions(resident=0.0, strategy="pread",
                                               units="decoder.blocks.*"),
                    tensors=tensors)
    assert len(pyloader.stats(model)["units"]) == WHISPER_DIMS["n_text_layer"]
    assert same(forward("whisper", model), forward("whisper", engine_load("whisper", path)))


def test_stream_llava_with_the_engines_sanitize(dirs):
    vu = need("mlx_vlm.utils")
    path = dirs("llava")
    config = vu.load_config(path)
    arch, _ = vu.get_model_and_args(config)
    config.setdefault("audio_config", {})
    mc = vu.update_module_configs(arch.ModelConfig.from_dict(config), arch, config,
                                  ["text", "vision"])
    model = arch.Model(mc)

    def sanitize(weights):  # mlx-vlm's steps, in its order
        weights = vu.sanitize_weights(model, weights)
        weights = vu.sanitize_weights(arch.VisionModel, weights, mc.vision_config)
        return vu.sanitize_weights(arch.LanguageModel, weights, mc.text_config)

    patterns = ["vision_tower.vision_model.encoder.layers.*",
                "language_model.model.layers.*"]
    pyloader.stream(model, path, StreamOptions(resident=0.5, units=patterns),
                    sanitize=sanitize)
    model.eval()
    assert len(pyloader.stats(model)["units"]) == 3  # of 5 blocks
    assert same(forward("llava", model), forward("llava", engine_load("llava", path)))


def test_stream_bert_with_its_own_sanitize(dirs):
    utils = need("mlx_embeddings.utils")
    path = dirs("bert")
    model_cls, args_cls, _, _ = utils._get_classes(BERT)
    model = model_cls(args_cls.from_dict(BERT))
    pyloader.stream(model, path, StreamOptions(resident=0.0))  # decoder_layers' rule
    model.eval()
    assert len(pyloader.stats(model)["units"]) == BERT["num_hidden_layers"]
    assert same(forward("bert", model), forward("bert", engine_load("bert", path)))


# --------------------------------------------------------------------------------------
# Errors

def test_a_missing_engine_is_named(dirs, monkeypatch):
    for name, pkg in (("llava", "mlx-vlm"), ("whisper", "mlx-whisper"),
                      ("bert", "mlx-embeddings")):
        path = dirs(name)
        monkeypatch.setitem(sys.modules, ENGINE_OF[name], None)  # find_spec: not installed
        with pytest.raises(pyloader.EngineNotInstalledError, match=pkg) as err:
            pyloader.load_model(path)
        assert err.value.package == pkg and isinstance(err.value, ImportError)
        monkeypatch.undo()


def test_a_vision_model_never_loads_text_only(dirs, monkeypatch):
    """A llava directory is mlx-vlm's even when mlx-vlm is missing (mlx-lm would load
    its language model alone)."""
    path = dirs("llava")
    model, _ = pyloader.load_model(path)
    assert type(model).__module__.startswith("mlx_vlm.models.llava")
    assert any(p.startswith("vision_tower.") for p, _ in tree_flatten(model.parameters()))
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)
    assert engines.detect(path) == "mlx_vlm"
    with pytest.raises(pyloader.EngineNotInstalledError, match="mlx-vlm"):
        pyloader.load_model(path)


def test_a_directory_the_engine_cannot_build(dirs, tmp_path):
    need("mlx_whisper")
    npz = tmp_path / "npz"  # mlx-whisper's older format: no safetensors to read
    npz.mkdir()
    (npz / "config.json").write_text((dirs("whisper") / "config.json").read_text())
    mx.savez(str(npz / "weights.npz"), **mx.load(str(dirs("whisper") / "weights.safetensors")))
    with pytest.raises(pyloader.EngineError, match="no safetensors checkpoint"):
        pyloader.load_model(npz)
    with pytest.raises(pyloader.EngineError, match="mlx-whisper cannot build"):
        pyloader.load_model(dirs("llava"), engine="mlx_whisper")
    with pytest.raises(ValueError, match="unknown engine 'whisper'"):
        pyloader.load_model(dirs("llava"), engine="whisper")


def test_unit_patterns_are_checked(dirs):
    path = dirs("whisper")
    with pytest.raises(ValueError, match=r"'encoder\.layers\.\*' matches no module"):
        engines.load(path, options=StreamOptions(units=["encoder.layers.*"]))
    with pytest.raises(ValueError, match="must not nest"):
        engines.load(path, options=StreamOptions(units=["encoder.blocks.*",
                                                        "encoder.blocks.0.mlp1"]))
    with pytest.raises(ValueError, match="not a module path pattern"):
        StreamOptions(units="encoder..blocks")
    with pytest.raises(TypeError, match="units"):
        StreamOptions(units=[3])
    assert StreamOptions(units=["a.*", "b.*"]).units == ("a.*", "b.*")


def test_engines_are_imported_only_when_used():
    """Importing pyloader and detecting an engine import no engine."""
    code = ("import sys, pyloader, pyloader.engines, pyloader.loading\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mlx_vlm', 'mlx_whisper', 'mlx_embeddings', 'transformers')))")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
    assert importlib.util.find_spec("pyloader.engines") is not None


def test_engine_models_take_the_kernels_choice(dirs):
    """kernels= applies to engine models as to mlx-lm's: "auto" puts pyloader's CPU
    kernels under their linear layers, "mlx" keeps MLX's ops (the bit-identical runs
    above use it: tests/conftest.py sets PYLOADER_KERNELS=mlx)."""
    model = model_of("bert", pyloader.load_model(dirs("bert"), kernels="auto"))
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert "CpuLinear" in kinds or "CpuQuantizedLinear" in kinds, kinds
    model = model_of("bert", pyloader.load_model(dirs("bert"), kernels="mlx"))
    assert not {type(m).__name__ for _, m in model.named_modules()} & {"CpuLinear"}
