"""Hostile or broken ``config.json`` values get :class:`pyloader.ConfigError` naming the
file and the field before mlx-lm builds the model's skeleton, because mlx-lm
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


# ------------------------------------------------------- every path that builds a model
# (plain load_model, head bundles, the planner, strict=False and a model without weights
# each build a model: none may reach mlx-lm with a hostile value)

EVERY_PATH_CASES = [("vocab_size", -5), ("vocab_size", 0), ("num_attention_heads", 0),
                    ("num_hidden_layers", 100_000)]

# Run in a child limited to 3 GiB of address space: a regression builds 100,000 layers
# (2.7 GB, then std::bad_alloc) instead of refusing them, and must not OOM the machine.
CHILD = """
import json, sys
from pathlib import Path
import pyloader
from pyloader.residency.budget import model_budget
from pyloader.residency.planner import plan
d = Path(sys.argv[1])
base = json.loads((d / "config.json").read_text())
for field, value in json.loads(sys.argv[2]):
    (d / "config.json").write_text(json.dumps({{**base, field: value}}))
    try:
        {call}
        print("built", field, value, flush=True)
    except pyloader.ConfigError as e:
        print("ConfigError", field, value, e.file, e.field, flush=True)
    except Exception as e:
        print(type(e).__name__, field, value, repr(e)[:200], flush=True)
"""

CALLS = {
    "head bundle": "pyloader.load_model(d, tokenizer=False)",
    "strict=False": "pyloader.load_model(d, tokenizer=False, strict=False)",
    "no weights": "pyloader.load_model(d, tokenizer=False, strict=False)",
    "model_budget": "model_budget(d / 'config.json')",
    "plan": "plan(d, 1 << 30)",
    "model_budget(dict)": "model_budget(json.loads((d / 'config.json').read_text()))",
}


def run_capped(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    limit = 3 << 30

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=cap, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(TESTS)})


def path_dir(kind: str, model_dir: Path, tmp_path: Path) -> Path:
    """A writable directory for ``kind``'s call."""
    d = tmp_path / "m"
    if kind == "head bundle":
        from pyloader import heads

        heads.build(model_dir, {"a": model_dir}, 1, d)
    elif kind == "no weights":
        d.mkdir()
        (d / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    else:
        d = with_config(model_dir, tmp_path)
    return d


@pytest.mark.parametrize("kind", list(CALLS))
def test_every_path_that_builds_a_model_checks_the_config(model_dir, tmp_path, kind):
    d = path_dir(kind, model_dir, tmp_path)
    code = CHILD.format(call=CALLS[kind])
    proc = run_capped(code, str(d), json.dumps(EVERY_PATH_CASES))
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-1500:])
    lines = proc.stdout.splitlines()
    assert len(lines) == len(EVERY_PATH_CASES), proc.stdout
    file = "None" if kind == "model_budget(dict)" else str(d / "config.json")
    for (field, value), line in zip(EVERY_PATH_CASES, lines):
        assert line == f"ConfigError {field} {value} {file} {field}", line


def test_sizes_are_bounded_whatever_strict_is(model_dir, tmp_path):
    from pyloader.io.config import MAX_LAYERS, MAX_PARAMETERS

    d = with_config(model_dir, tmp_path, num_hidden_layers=MAX_LAYERS + 1)
    for strict in (True, False):
        with pytest.raises(pyloader.ConfigError, match="largest value") as e:
            check_config(d, pyloader.open(d), strict=strict)
        assert e.value.field == "num_hidden_layers"
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_hidden_layers=MAX_LAYERS, hidden_size=1 << 16, intermediate_size=1 << 20,
               num_attention_heads=1 << 8, num_key_value_heads=1 << 8, head_dim=None)
    assert estimated_parameters(cfg) > MAX_PARAMETERS
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(pyloader.ConfigError, match="parameters, above the largest"):
        check_config(d, strict=False)
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 2**31}))
    with pytest.raises(pyloader.ConfigError, match="largest value") as e:
        check_config(d, strict=False)
    assert e.value.field == "vocab_size"


# ----------------------------------------------------------- not a regular file (FIFO)

FIFO_CHILD = """
import sys
from pathlib import Path
import pyloader
from pyloader.residency.budget import model_budget
d = Path(sys.argv[1])
try:
    {call}
    print("loaded")
except pyloader.ConfigError as e:
    print("ConfigError", e.file, e)
"""


@pytest.mark.parametrize("name,call", [
    ("config.json", "pyloader.load_model(d)"),
    ("config.json", "pyloader.load_model(d, strict=False)"),
    ("config.json", "model_budget(d)"),
    ("generation_config.json", "pyloader.load_model(d)"),
    ("tokenizer.json", "pyloader.load_model(d)"),
])
def test_a_config_that_is_a_fifo_is_refused_without_blocking(model_dir, tmp_path, name, call):
    """A FIFO config.json (or a file mlx-lm or the tokenizer reads beside it) blocked
    load_model's read forever; now ConfigError naming the file, in a child with a
    timeout so that a regression fails instead of hanging the suite."""
    d = with_config(model_dir, tmp_path)
    if (d / name).exists():
        (d / name).unlink()
    os.mkfifo(d / name)
    proc = run_capped(FIFO_CHILD.format(call=call), str(d), timeout=90)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert proc.stdout.startswith(f"ConfigError {d / name} "), proc.stdout
    assert "must be a regular file, not a FIFO" in proc.stdout


# ------------------------------------------------------------------------- model_file

EVIL = ("import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"
        "from mlx_lm.models.llama import Model, ModelArgs\n")


def remote_code_dir(model_dir: Path, tmp_path: Path, model_file: str) -> tuple[Path, Path]:
    """A model directory whose config names ``model_file``, and the marker file that
    any copy of evil.py (inside or outside the directory) writes when imported."""
    marker = tmp_path / "ran"
    d = with_config(model_dir, tmp_path, model_file=model_file)
    outside = tmp_path / "outside"
    outside.mkdir()
    for where in (tmp_path, outside, d):
        (where / "evil.py").write_text(EVIL.format(marker=str(marker)))
    (d / "lnk").symlink_to(outside)
    return d, marker


@pytest.mark.parametrize("model_file", ["../evil.py", "ABS", "sub/../../evil.py",
                                        "lnk/evil.py", "", 7])
def test_model_file_outside_the_model_directory_is_refused_before_any_import(
        model_dir, tmp_path, model_file):
    if model_file == "ABS":
        model_file = str(tmp_path / "evil.py")
    d, marker = remote_code_dir(model_dir, tmp_path, model_file)
    with pytest.raises(pyloader.ConfigError, match="inside the model directory") as e:
        pyloader.load_model(d, tokenizer=False, trust_remote_code=True)
    assert e.value.field == "model_file" and e.value.file == str(d / "config.json")
    assert not marker.exists()


def test_model_file_inside_the_model_directory_still_runs(model_dir, tmp_path):
    """The rule refuses only what leaves the directory: a model_file inside it (here a
    symlink to a file outside, as the hub cache links every file to its blob) is
    imported as mlx-lm does, and the model loads."""
    d, marker = remote_code_dir(model_dir, tmp_path, "./code.py")
    (d / "code.py").symlink_to(tmp_path / "evil.py")
    model, _ = pyloader.load_model(d, tokenizer=False, trust_remote_code=True)
    assert marker.read_text() == "ran" and model is not None
