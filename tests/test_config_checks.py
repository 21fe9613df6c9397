"""Hostile or broken ``config.json`` values get :class:`pyloader.ConfigError` naming the
file and the field before mlx-lm builds the model's skeleton (issue 35 item 11): mlx-lm
itself was OOM-killed building 100,000 layers and raised a bare ``AssertionError`` /
``ZeroDivisionError`` for zero or negative sizes."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import pyloader
from models import make_model_dir
from pyloader.io.config import check_config, estimated_parameters

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("cfg") / "m", "llama", dtype=mx.float16)


def with_config(model_dir: Path, tmp_path: Path, **changes) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((model_dir / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


HOSTILE = [
    ("vocab_size", 0, "positive integer"),
    ("vocab_size", -5, "positive integer"),
    ("num_attention_heads", 0, "positive integer"),
    ("hidden_size", "64", "positive integer"),
    ("num_key_value_heads", 3, "do not divide"),
    ("num_hidden_layers", True, "positive integer"),
    ("num_hidden_layers", 9, "the checkpoint's tensors hold"),
    ("moe_intermediate_size", -1, "non-negative integer"),
]


def test_zero_where_mlx_lm_means_unset_is_accepted(model_dir, tmp_path):
    """mlx-lm's ernie4_5_moe defaults moe_intermediate_size to 0 ("use
    intermediate_size"), and its own test config says 0: not a config error."""
    d = with_config(model_dir, tmp_path, moe_intermediate_size=0, num_experts=0)
    model, _ = pyloader.load_model(d, tokenizer=False)
    assert model is not None


@pytest.mark.parametrize("field,value,rule", HOSTILE,
                         ids=[f"{f}={v!r}" for f, v, _ in HOSTILE])
def test_hostile_config_value_is_a_config_error_naming_the_field(model_dir, tmp_path,
                                                                 field, value, rule):
    d = with_config(model_dir, tmp_path, **{field: value})
    with pytest.raises(pyloader.ConfigError, match=rule) as e:
        pyloader.load_model(d)
    assert e.value.field == field and e.value.file == str(d / "config.json")
    assert isinstance(e.value, ValueError)


def test_model_config_overrides_are_checked_too(model_dir):
    with pytest.raises(pyloader.ConfigError, match="vocab_size"):
        pyloader.load_model(model_dir, model_config={"vocab_size": 0})


def test_a_hundred_thousand_layers_is_refused_before_the_skeleton(model_dir, tmp_path):
    """In a child limited to 3 GiB of address space and 120 s: mlx-lm built the skeleton
    until the OOM killer came (8.9 GB after 120 s); now ConfigError, at once."""
    d = with_config(model_dir, tmp_path, num_hidden_layers=100_000)
    limit = 3 << 30

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    code = (f"import pyloader\n"
            f"try:\n    pyloader.load_model({str(d)!r})\n"
            f"except pyloader.ConfigError as e:\n    print('ConfigError', e.field, e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, preexec_fn=cap, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert proc.stdout.startswith("ConfigError num_hidden_layers"), proc.stdout


def test_a_config_far_larger_than_its_checkpoint_is_refused(model_dir, tmp_path):
    d = with_config(model_dir, tmp_path, hidden_size=65536, intermediate_size=262144,
                    num_attention_heads=512, num_key_value_heads=512, head_dim=None)
    with pytest.raises(pyloader.ConfigError, match="parameters") as e:
        check_config(d, pyloader.open(d))
    assert e.value.field == "num_hidden_layers"


def test_the_estimate_is_within_the_bound_for_real_configs(model_dir):
    """The bound (16 parameters per stored byte) is far from what real checkpoints
    hold: the test model, and the default model (8-bit quantized)."""
    from pyloader.default_model import default_model_path

    for d in (model_dir, default_model_path()):
        cfg = json.loads((Path(d) / "config.json").read_text())
        ratio = estimated_parameters(cfg) / pyloader.open(d).total_nbytes
        assert 0.3 < ratio < 4, (d, ratio)
        check_config(d, pyloader.open(d))


def test_text_config_is_checked(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "x",
                                               "text_config": {"vocab_size": -1}}))
    with pytest.raises(pyloader.ConfigError) as e:
        check_config(d)
    assert e.value.field == "text_config.vocab_size"


def test_valid_config_loads(model_dir):
    model, _ = pyloader.load_model(model_dir)
    assert model is not None
