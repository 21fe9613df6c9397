"""``pyloader.load_model`` keeps ``mlx_lm.load``'s contract: Hugging Face repo ids from the
local hub cache, ``model_config``, ``return_config``, ``strict``, ``get_model_classes``,
``trust_remote_code`` (models without a ``.layers`` list), ``adapter_path``, ``lazy``,
``tokenizer_config``; ``sanitize`` sees the real values; ``pyloader.load`` returns metadata
like ``mx.load``. Every output is compared bit for bit with mlx-lm's own load."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_adapters
from mlx_lm.utils import load_model as mlx_lm_load_model
from models import logits, make_model_dir

import pyloader
from pyloader.cli import main as cli_main

TOKENS = [1, 5, 9, 200, 17, 3]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "llama", "llama",
                          dtype=mx.float32, num_hidden_layers=3)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "q4", "qwen3", bits=4,
                          num_hidden_layers=3)


def reference(path: Path, **kw) -> mx.array:
    model, _ = mlx_lm_load_model(path, **kw)
    return logits(model, TOKENS)


def ours(path, **kw) -> mx.array:
    model, _ = pyloader.load_model(path, tokenizer=False, **kw)
    return logits(model, TOKENS)


# -- Hugging Face repo ids -------------------------------------------------------------


def hub_layout(cache: Path, repo: str, src: Path, commit: str = COMMIT,
               refs: tuple[str, ...] = ("main",)) -> Path:
    """``src``'s files laid out as huggingface_hub caches them: content-addressed blobs,
    a snapshot of symlinks, refs naming the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny) -> Path:
    cache = tmp_path / "hub"
    hub_layout(cache, "tiny-org/tiny-llama", tiny, refs=("main", "v1"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.mark.parametrize("revision", [None, "main", "v1", COMMIT, COMMIT[:10]])
def test_a_repo_id_loads_from_the_hub_cache(hub, tiny, revision):
    assert mx.array_equal(ours("tiny-org/tiny-llama", revision=revision, resident=0),
                          reference(tiny))


def test_repo_ids_work_for_load_open_and_the_cli(hub, tiny, capsys):
    want = mx.load(str(tiny / "model.safetensors"))
    got = pyloader.load("tiny-org/tiny-llama")
    assert set(got) == set(want) and all(mx.array_equal(got[k], want[k]) for k in want)
    assert len(pyloader.open("tiny-org/tiny-llama")) == len(want)
    assert cli_main(["inspect", "tiny-org/tiny-llama"]) == 0
    assert "tensors" in capsys.readouterr().out


def test_an_absent_repo_offline_names_the_repo_and_the_cache(hub):
    with pytest.raises(pyloader.ModelNotFoundError) as e:
        pyloader.load_model("tiny-org/absent", tokenizer=False)
    assert "tiny-org/absent" in str(e.value) and str(hub) in str(e.value)
    assert "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(FileNotFoundError, match="'nope'"):  # an absent revision
        pyloader.load_model("tiny-org/tiny-llama", revision="nope", tokenizer=False)


def test_online_a_missing_repo_is_downloaded_with_huggingface_hub(hub, tiny, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, allow_patterns))
        return str(tiny)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert mx.array_equal(ours("other-org/new-model", revision="r2"), reference(tiny))
    assert calls and calls[0][:2] == ("other-org/new-model", "r2")
    assert "model*.safetensors" in calls[0][2]
    # A cached repo is not downloaded again.
    ours("tiny-org/tiny-llama")
    assert len(calls) == 1


# -- mlx_lm.load's other arguments ----------------------------------------------------


@pytest.mark.parametrize("resident", [0, 1.0])
def test_model_config_and_return_config(tiny, resident):
    over = {"rms_norm_eps": 0.5}
    model, tok, config = pyloader.load_model(tiny, model_config=over, return_config=True,
                                             resident=resident)
    _, want_config = mlx_lm_load_model(tiny, model_config=over)
    assert tok is None and config == want_config and config["rms_norm_eps"] == 0.5
    got = logits(model, TOKENS)
    assert mx.array_equal(got, reference(tiny, model_config=over))
    assert not mx.array_equal(got, reference(tiny))  # the override changed something


def test_get_model_classes_builds_the_model(tiny):
    from mlx_lm.models import llama

    seen = []

    def classes(config):
        seen.append(config["model_type"])
        return llama.Model, llama.ModelArgs

    assert mx.array_equal(ours(tiny, get_model_classes=classes, resident=0),
                          reference(tiny))
    assert seen and seen[0] == "llama"


def test_strict_false_without_weights_gives_the_initialized_model(tmp_path, tiny):
    shutil.copy(tiny / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="No safetensors"):
        pyloader.load_model(tmp_path, tokenizer=False)
    mx.random.seed(3)
    model, _ = pyloader.load_model(tmp_path, tokenizer=False, strict=False)
    mx.random.seed(3)
    want, _ = mlx_lm_load_model(tmp_path, strict=False)
    assert mx.array_equal(logits(model, TOKENS), logits(want, TOKENS))


def test_strict_false_ignores_extra_tensors_and_keeps_missing_ones(tmp_path, tiny):
    weights = mx.load(str(tiny / "model.safetensors"))
    weights["not.a.parameter"] = mx.zeros((3,))
    missing = "model.layers.1.post_attention_layernorm.weight"
    del weights[missing]
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny / "config.json", d / "config.json")
    mx.save_safetensors(str(d / "model.safetensors"), weights)
    with pytest.raises(ValueError):
        pyloader.load_model(d, tokenizer=False)
    for resident in (0, 1.0):
        model, _ = pyloader.load_model(d, tokenizer=False, strict=False, resident=resident)
        want, _ = mlx_lm_load_model(d, strict=False)
        assert mx.array_equal(logits(model, TOKENS), logits(want, TOKENS))
        params = dict(tree_flatten(model.parameters()))
        assert mx.array_equal(params[missing], mx.ones_like(params[missing]))  # RMSNorm init


def test_lazy_false_evaluates_and_lazy_true_works(tiny):
    for lazy in (False, True):
        assert mx.array_equal(ours(tiny, lazy=lazy, resident=0.5), reference(tiny))


def test_load_returns_metadata_like_mx_load(tiny):
    f = str(tiny / "model.safetensors")
    arrays, meta = pyloader.load(f, return_metadata=True)
    want, want_meta = mx.load(f, return_metadata=True)
    assert meta == want_meta and set(arrays) == set(want)


def test_tokenizer_config_and_eos_ids_reach_the_tokenizer(tmp_path, tiny):
    src = pyloader.default_model_path()
    d = tmp_path / "with-tok"
    shutil.copytree(tiny, d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, d / f)
    config = json.loads((d / "config.json").read_text())
    config["eos_token_id"] = [1, 2]
    (d / "config.json").write_text(json.dumps(config))
    _, tok = pyloader.load_model(d, tokenizer_config={"model_max_length": 123})
    assert tok._tokenizer.model_max_length == 123
    assert set(tok.eos_token_ids) == {1, 2}


# -- models mlx-lm builds from custom code, and sanitize on real values ----------------

CUSTOM_MODEL = '''
import mlx.core as mx
import mlx.nn as nn


class ModelArgs:
    @classmethod
    def from_dict(cls, params):
        return cls()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def __call__(self, x):
        return x + mx.tanh(self.proj(x))


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = [Block() for _ in range(BLOCKS)]
        self.signs = mx.ones((16,))
        self.out = nn.Linear(16, 32)

    def __call__(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h * self.signs)

    def sanitize(self, weights):
        if not mx.all(mx.abs(weights["signs"]) == 1).item():
            raise ValueError("signs must contain only -1 and +1")
        return weights
'''


def custom_model_dir(path: Path, blocks: int) -> Path:
    """A model whose architecture is the directory's own ``arch.py`` (no ``.layers``:
    its blocks are ``model.blocks``; none with ``blocks=0``) and whose ``sanitize``
    rejects zero-filled stand-ins of its sign vector."""
    path.mkdir(parents=True)
    (path / "arch.py").write_text(CUSTOM_MODEL.replace("BLOCKS", str(blocks)))
    (path / "config.json").write_text(json.dumps({"model_type": "custom",
                                                  "model_file": "arch.py"}))
    spec = importlib.util.spec_from_file_location("pyloader_test_arch", path / "arch.py")
    arch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arch)
    mx.random.seed(7)
    model = arch.Model(arch.ModelArgs())
    model.signs = mx.where(mx.random.uniform(shape=(16,)) > 0.5, 1.0, -1.0)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def test_custom_code_needs_trust_remote_code(tmp_path):
    d = custom_model_dir(tmp_path / "c", blocks=0)
    with pytest.raises(ValueError, match="trust_remote_code"):
        pyloader.load_model(d, tokenizer=False)
    assert not (d / "side_effect.txt").exists()


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
@pytest.mark.parametrize("blocks,resident", [(0, 0), (0, 1.0), (3, 0), (3, 0.5), (3, 1.0)])
def test_models_without_layers_load_and_stream_their_block_list(tmp_path, blocks, resident,
                                                                strategy):
    d = custom_model_dir(tmp_path / "c", blocks=blocks)
    model, _ = pyloader.load_model(d, tokenizer=False, trust_remote_code=True, resident=resident,
                                   options=pyloader.StreamOptions(strategy=strategy))
    want, _ = mlx_lm_load_model(d, trust_remote_code=True)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert mx.array_equal(model(tokens), want(tokens))
    s = pyloader.stats(model)
    streamed = {0: 3, 0.5: 1}.get(resident, 0) if blocks else 0
    assert s["streamed_units"] == streamed
    assert len(s["resident_layers"]) == blocks - streamed
    if streamed:
        assert s["bytes_read"] > 0 and all(u["loads"] for u in s["units"].values())


# -- LoRA adapters on top of streamed layers ------------------------------------------


def make_adapter(path: Path, model_dir: Path, fine_tune_type: str = "lora") -> Path:
    """A LoRA adapter for ``model_dir``'s model with random (non-zero) A and B."""
    model, _ = mlx_lm_load_model(model_dir)
    params = {"rank": 4, "scale": 4.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(11)
    adapters = {k: 0.05 * mx.random.normal(v.shape).astype(v.dtype)
                for k, v in tree_flatten(model.parameters())
                if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), adapters)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": fine_tune_type, "num_layers": 2, "lora_parameters": params}))
    return path


def with_adapter(model_dir: Path, adapter: Path) -> mx.array:
    model, _ = mlx_lm_load_model(model_dir)
    model = load_adapters(model, str(adapter))
    model.eval()
    return logits(model, TOKENS)


@pytest.mark.parametrize("strategy", ["mmap", "pread"])
@pytest.mark.parametrize("resident", [0, 0.5, 1.0])
@pytest.mark.parametrize("which", ["tiny", "tiny_q4"])
def test_lora_adapters_apply_on_streamed_layers(request, tmp_path, which, resident, strategy):
    model_dir = request.getfixturevalue(which)
    adapter = make_adapter(tmp_path / "adapter", model_dir)
    want = with_adapter(model_dir, adapter)
    assert not mx.array_equal(want, reference(model_dir))  # the adapter changes the output
    model, _ = pyloader.load_model(model_dir, adapter_path=adapter, tokenizer=False,
                                   resident=resident,
                                   options=pyloader.StreamOptions(strategy=strategy))
    for _ in range(2):  # the second pass re-reads every streamed layer
        assert mx.array_equal(logits(model, TOKENS), want)
    lora = [m for _, m in model.named_modules() if type(m).__name__ == "LoRALinear"]
    assert lora and not model.training


def test_a_full_fine_tune_adapter_needs_resident_layers(tmp_path, tiny):
    adapter = make_adapter(tmp_path / "adapter", tiny, fine_tune_type="full")
    with pytest.raises(ValueError, match="full fine-tune"):
        pyloader.load_model(tiny, adapter_path=adapter, tokenizer=False, resident=0)


def test_a_module_list_is_found_where_model_layers_is_absent():
    from pyloader.streaming.units import decoder_layers

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = [nn.RMSNorm(4) for _ in range(5)]  # longer, but tiny
            self.h = [nn.Linear(64, 64) for _ in range(5)]

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = Inner()

    m = Outer()
    assert decoder_layers(m) == m.transformer.h
    assert decoder_layers(nn.Linear(2, 2)) == []
