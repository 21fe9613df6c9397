"""The ``pyloader`` command: every subcommand on tiny models, plus the package polish
(``python -m pyloader``, the extension's type stub)."""

from __future__ import annotations

import ast
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import pyloader
from pyloader.compare import genbench, harness
from pyloader.cli import main
from synthetic import main as write_synthetic  # bench/synthetic.py

from models import make_model_dir
from stbytes import entry, st


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("llama4"), "llama", bits=4)


# ---------------------------------------------------------------------------- package polish


def test_python_m_pyloader():
    out = subprocess.run([sys.executable, "-m", "pyloader", "--version"], capture_output=True,
                         text=True, check=True, cwd="/")
    lines = out.stdout.splitlines()
    assert lines[0] == f"pyloader {pyloader.__version__} (distribution pyloader-mlx)"
    # What this build has: MLX, and whether io_uring is in (liburing-dev at build time).
    assert lines[1].startswith(f"MLX {mx.__version__} (built against ")
    from pyloader._native import core
    from pyloader.cli import io_uring_text

    assert lines[2] == "readers: mmap, pread (threads); io_uring: " + io_uring_text(
        pyloader.uring_available(), core.uring_built(), core.platform()["portable_io"])
    out = subprocess.run([sys.executable, "-m", "pyloader"], capture_output=True, text=True,
                         cwd="/")
    assert out.returncode == 2
    for command in ("compare", "generate", "inspect", "convert-gguf", "serve"):
        assert command in out.stdout


def test_version_names_the_portable_io_switch():
    """Under PYLOADER_PORTABLE_IO=1, --version blames the switch, not liburing-dev
    (a build that has io_uring must not be told to install liburing-dev)."""
    from pyloader._native import core

    env = {**os.environ, "PYLOADER_PORTABLE_IO": "1"}
    out = subprocess.run([sys.executable, "-m", "pyloader", "--version"], capture_output=True,
                         text=True, check=True, cwd="/", env=env)
    line = out.stdout.splitlines()[2]
    assert line.startswith("readers: mmap, pread (threads); io_uring: no (turned off by "
                           "PYLOADER_PORTABLE_IO=1: unset it to use io_uring"), line
    assert ("liburing-dev" in line) == (not core.uring_built()), line


@pytest.mark.parametrize("available,built,switch,says", [
    (True, True, False, "yes"),
    (False, True, True, "no (turned off by PYLOADER_PORTABLE_IO=1: unset it to use io_uring)"),
    (False, False, True, ("no (turned off by PYLOADER_PORTABLE_IO=1: unset it to use "
                          "io_uring; this build has no io_uring either (built without "
                          "liburing-dev))")),
    (False, False, False, ("no (built without liburing-dev: apt-get install liburing-dev, "
                           "then reinstall pyloader to build it in)")),
    (False, True, False, "no (built in, but the kernel refuses io_uring to this process"),
])
def test_version_gives_the_true_reason_io_uring_is_off(available, built, switch, says):
    from pyloader.cli import io_uring_text

    assert io_uring_text(available, built, switch).startswith(says)


def test_the_distribution_is_pyloader_mlx():
    """PyPI's "pyloader" is another project: this one installs as pyloader-mlx (the import
    name stays pyloader), and the command comes from it."""
    from importlib.metadata import distribution, entry_points

    dist = distribution("pyloader-mlx")
    assert any(str(f).startswith("pyloader/") for f in dist.files)
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "pyloader"]
    assert script.dist.name == "pyloader-mlx" and script.value == "pyloader.cli:main"
    # Messages that tell the user what to install name it even when no metadata says so
    # (a source tree on sys.path): never PyPI's unrelated "pyloader".
    from pyloader import _native

    assert _native.DISTRIBUTION == dist.metadata["Name"]


def test_type_stub_declares_the_extension():
    """The wheel ships _core.pyi (from nanobind's stubgen at build time) and py.typed,
    and the stub declares every public name of the extension as it is now."""
    from pyloader import _core

    here = Path(_core.__file__).parent
    assert (here / "py.typed").is_file()
    tree = ast.parse((here / "_core.pyi").read_text())
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            declared.add(node.name)
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            declared.update(t.id for t in targets if isinstance(t, ast.Name))
    public = {n for n in dir(_core) if not n.startswith("_")}
    assert public <= declared, f"missing from the stub: {sorted(public - declared)}"
    # MLX's array type was registered when the stub was made (not a C++ type name).
    assert "mlx.core.array" in (here / "_core.pyi").read_text()
    assert "mlx::core" not in (here / "_core.pyi").read_text()


def test_public_functions_have_docstrings():
    import inspect

    for name in pyloader.__all__:
        obj = getattr(pyloader, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__, f"pyloader.{name} has no docstring"
    import importlib
    import pkgutil

    public = [m.name for m in pkgutil.iter_modules(pyloader.__path__) if not m.name.startswith("_")]
    assert {"cli", "streaming", "kv", "heads"} <= set(public)
    for mod in (importlib.import_module(f"pyloader.{m}") for m in public):
        for name, obj in vars(mod).items():
            if ((inspect.isfunction(obj) or inspect.isclass(obj))
                    and obj.__module__ == mod.__name__ and not name.startswith("_")):
                assert obj.__doc__, f"{mod.__name__}.{name} has no docstring"


# ---------------------------------------------------------------------------- convert-gguf


def test_convert_gguf(tmp_path, capsys):
    from test_gguf import tiny_llama_gguf

    src = tiny_llama_gguf(tmp_path / "tiny.gguf", {})
    assert main(["convert-gguf", str(src), str(tmp_path / "out"), "--dtype", "f16"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float16"
    assert {t.dtype for t in pyloader.open(tmp_path / "out").tensors()} == {"F16"}

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 60)
    assert main(["convert-gguf", str(bad), str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert "FormatError" in err and "not a GGUF file" in err
    assert main(["convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------------------- inspect


def test_inspect_text_and_json(tiny_q4, capsys):
    assert main(["inspect", str(tiny_q4)]) == 0
    text = capsys.readouterr().out
    assert "layers: 2" in text and "4-bit, group 32" in text and "itemsize-aligned" in text

    assert main(["inspect", str(tiny_q4), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    ckpt = pyloader.open(tiny_q4)
    assert info["tensors"] == len(ckpt) and info["bytes"] == ckpt.total_nbytes
    groups = list(info["layers"].values()) + list(info["other"].values())
    assert sum(g["bytes"] for g in groups) == ckpt.total_nbytes
    assert sum(g["tensors"] for g in groups) == len(ckpt)
    assert sum(d["bytes"] for d in info["dtypes"].values()) == ckpt.total_nbytes
    a = ckpt.alignment_summary()
    assert info["alignment"]["itemsize"] == {"tensors": a["aligned_tensors"],
                                             "bytes": a["aligned_bytes"]}
    page = [t for t in ckpt.tensors() if t.offset % info["alignment"]["page_size"] == 0]
    assert info["alignment"]["page"]["tensors"] == len(page)
    # Every linear layer of the 4-bit model: 2 layers x 7 projections + embedding + lm_head.
    layouts = info["quantization"]["layouts"]
    assert [(q["bits"], q["group_size"]) for q in layouts] == [(4, 32)]
    assert layouts[0]["modules"] == 2 * 7 + 2


def test_inspect_unquantized_aligned(aligned_file, capsys):
    assert main(["inspect", str(aligned_file), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["alignment"]["misaligned"]["tensors"] == 0
    assert info["quantization"]["layouts"] == []
    assert info["files"][0]["metadata"] == {"who": "safetensors"}


def test_inspect_broken_file(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(st('{"w":' + entry("F32", [4], 0, 16) + "}", b"\0" * 12))  # truncated
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "invalid checkpoint" in err and str(bad) in err
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize("content, says", [
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 100, "It looks like a PNG image"),
    (b'{"not": "a header"}\n', "It looks like JSON text"),
    (b"abc", "(3 bytes; a safetensors file starts with its header's length"),
    (b"\x08\0\0\0\0\0\0\0[1, 2]  ", "not a JSON object"),
])
def test_inspect_a_file_that_is_not_safetensors(tmp_path, content, says, capsys):
    """A PNG, a JSON file: "not a safetensors file", the file, the rule and what it
    looks like (it was "header length 727905341920923785 exceeds the limit")."""
    f = tmp_path / "picture.png"
    f.write_bytes(content)
    assert main(["inspect", str(f)]) == 1
    err = capsys.readouterr().err
    assert f"{f}: not a safetensors file" in err and says in err
    assert "little-endian" in err  # the rule


def test_inspect_a_gguf_file_names_its_conversion(tmp_path, capsys):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"GGUF\x03\0\0\0" + b"\0" * 64)
    assert main(["inspect", str(f)]) == 1
    err = capsys.readouterr().err
    assert f"{f}: a GGUF file" in err and f"pyloader convert-gguf {f} OUT_DIR" in err


def test_inspect_an_empty_directory(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "no *.safetensors file" in err
    assert "find *.safetensors in directory failed" not in err


# --------------------------------------------------------- synthetic (bench/synthetic.py)


def test_synthetic(tmp_path, capsys):
    path = tmp_path / "s.safetensors"
    assert write_synthetic([str(path), "--size", "1MiB", "--writer", "mlx"]) == 0
    assert str(path) in capsys.readouterr().out
    ckpt = pyloader.open(path)
    assert 0.9 * 2**20 < ckpt.total_nbytes < 1.5 * 2**20


def test_synthetic_shape(tmp_path, capsys):
    """--shape: a sharded model directory (tests/test_scale.py checks its contents)."""
    out = tmp_path / "m"
    assert write_synthetic([str(out), "--shape", "llama3.1-8b", "--format", "q4", "--tiny",
                            "--shard-size", "1MB"]) == 0
    printed = capsys.readouterr()
    text = printed.out
    assert "llama3.1-8b q4" in text and "tensors aligned" in text
    shards = len(list(out.glob("model-*-of-*.safetensors")))
    assert shards > 1 and f"{shards} shards" in text
    assert (out / "model.safetensors.index.json").exists()
    # mlx-lm's "[INFO] Quantized model with ..." stays out; the size is in units (the
    # tiny model printed "0.00 GB").
    assert "Quantized" not in printed.out + printed.err, printed.out
    from pyloader._util.sizes import format_bytes

    total = pyloader.open(out).total_nbytes
    assert total < 1e8 and f"tensors, {format_bytes(total)}, " in text, text


def test_synthetic_models_carry_a_tokenizer(tmp_path, capsys):
    """A synthetic model (here a sharded tiny llama3.1-8b shape) loads with a tokenizer
    and generates end to end: pyloader generate with its chat template, load_model's
    tokenizer decoding what mlx-lm generates."""
    from mlx_lm import generate

    out = tmp_path / "m"
    assert write_synthetic([str(out), "--shape", "llama3.1-8b", "--tiny"]) == 0
    capsys.readouterr()
    model, tokenizer = pyloader.load_model(out, resident="50%")
    assert tokenizer is not None and tokenizer.has_chat_template
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"
    assert isinstance(generate(model, tokenizer, "Hello", max_tokens=6), str)
    from pyloader.generation import prompt_tokens

    templated = len(prompt_tokens(tokenizer, "Hello"))
    assert templated > len(tokenizer.encode("Hello"))  # the chat template wraps it
    assert main(["generate", str(out), "-p", "Hello", "-m", "4"]) == 0
    printed = capsys.readouterr()
    assert f"Prompt: {templated} tokens" in printed.out and "Generation: " in printed.out


def test_synthetic_moe_model_runs_the_readme_example(tmp_path):
    """The README's mixture-of-experts example on a synthetic qwen3_moe: it has a
    tokenizer now (load_model returned None, then .decode raised AttributeError)."""
    import mlx_lm

    from benchlib.synthetic import make_moe_model

    path = make_moe_model(tmp_path / "moe", 30_000_000, num_experts=8, top_k=2)
    model, tokenizer = pyloader.load_model(path, options=pyloader.StreamOptions(experts=0.25))
    with pyloader.streaming.controller_of(model).routing_trace() as trace:
        text = mlx_lm.generate(model, tokenizer, "Hello", max_tokens=4)
    assert isinstance(text, str) and text
    assert pyloader.stats(model)["experts"]["total"]["misses"] > 0
    assert 0 <= pyloader.streaming.simulate(trace, 1, "lru")["total"]["hit_rate"] <= 1


# ---------------------------------------------------------------------------- generate


def test_generate_streams_the_default_model(capsys):
    """Every layer streamed (resident 0): the real model still says Paris."""
    from pyloader.default_model import default_model_path

    model = str(default_model_path())
    assert main(["generate", model, "--prompt", "The capital of France is",
                 "--ignore-chat-template", "--max-tokens",
                 "3", "--resident", "0"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out
    assert "30 streamed units" in out.err and "tok/s" in out.err


def test_generate_errors(tiny_llama, tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert main(["generate", str(tiny_llama), "--prompt", "x"]) == 1  # no tokenizer
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["generate", str(tiny_llama), "--prompt", "x", "--resident", "lots"]) == 2
    assert "4layers" in capsys.readouterr().err  # says what to write
    assert main(["generate", str(tiny_llama), "--model", str(tmp_path), "-p", "x"]) == 2
    assert "two models" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("1", "write 1layer for one layer, or 100%"),
    ("2.0", "write 2layers"),
    ("150%", "at most 100%"),
])
def test_generate_refuses_an_ambiguous_resident(tiny_llama, text, message, capsys):
    """``--resident 1`` (one layer, before) and ``--resident 1.0`` (every layer) must not
    silently differ: the bare 1 is refused, and so is a fraction above 1, each saying what
    to write; nothing is loaded."""
    assert main(["generate", str(tiny_llama), "-p", "x", "--resident", text]) == 2
    assert message in capsys.readouterr().err


def test_generate_residency_forms(capsys):
    """Every unambiguous form loads what it says (the default model has 30 layers)."""
    from pyloader.default_model import default_model_path

    model = str(default_model_path())
    # (warnings are errors here: "1layer" does not warn about the int 1)
    for form, streamed in (("1layer", 29), ("50%", 15), ("0.5", 15), ("all", 0),
                           ("none", 30), ("3", 27), ("3layers", 27)):
        assert main(["generate", model, "-p", "Hi", "-m", "1", "--ignore-chat-template",
                     "--resident", form]) == 0, form
        err = capsys.readouterr().err
        assert (f"{streamed} streamed units" in err) == (streamed > 0), (form, err)


def test_generate_budget_that_cannot_be_honoured_says_so(capsys):
    """--budget 10MB on a model whose embeddings and head alone are ~32 MB: it streams
    every layer and warns that the budget cannot be honoured, naming the real size."""
    from pyloader.default_model import default_model_path

    with pytest.warns(pyloader.ResidencyWarning, match="10.00 MB cannot be honoured") as w:
        assert main(["generate", str(default_model_path()), "-p", "Hi", "-m", "1",
                     "--budget", "10MB"]) == 0
    assert "10000000" not in str(w[0].message)  # in units, as typed (it said '10000000')
    assert "30 streamed units" in capsys.readouterr().err


def test_generate_help_shows_mlx_lm_flags_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--model", "--prompt PROMPT, -p", "--max-tokens N, -m N", "--temp", "--top-p",
                 "--min-p", "--top-k", "--seed", "--system-prompt", "--ignore-chat-template",
                 "--verbose", "--resident", "--trace"):
        assert flag in text, flag
    assert "(default 100)" in text and "default 'hello'" in text


def _mlx_lm_generate(args: list[str]) -> str:
    out = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", *args],
                         capture_output=True, text=True, cwd="/", timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


FRANCE = ["-p", "What is the capital of France?", "-m", "12"]


@pytest.mark.parametrize("flags", [
    FRANCE,
    ["-p", "Tell me a story", "-m", "10", "--temp", "1.0", "--seed", "3",
     "--system-prompt", "You are terse."],
    [*FRANCE, "--max-kv-size", "24", "--prefill-step-size", "8", "--trust-remote-code",
     "--use-default-chat-template"],
    [*FRANCE, "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"],
    ["-p", "Tell me a story", "-m", "10", "--temp", "1.0", "--seed", "3",
     "--xtc-probability", "1.0", "--xtc-threshold", "0.05"],
    [*FRANCE, "--draft-model", "MODEL", "--num-draft-tokens", "2"],
], ids=["greedy", "sampled", "rotating-kv", "quantized-kv", "xtc", "draft"])
def test_generate_matches_mlx_lm_generate(flags, capsys):
    """The same command line through mlx_lm.generate and pyloader generate on the default
    model: the same text and the same statistics lines (chat template on by default;
    with --seed, the same sampled text), mlx-lm's generation flags included."""
    from pyloader.default_model import default_model_path

    model = str(default_model_path())
    flags = [model if f == "MODEL" else f for f in flags]
    theirs = _mlx_lm_generate(["--model", model, *flags]).splitlines()
    assert main(["generate", "--model", model, *flags]) == 0
    ours = capsys.readouterr().out.splitlines()
    assert ours[:3] == theirs[:3]  # ==========, the text, ==========
    if "--temp" not in flags:
        assert "Paris" in ours[1]  # the chat template was applied (no template: a blank)
    for mine, ref in zip(ours[3:5], theirs[3:5], strict=True):
        assert mine.split(",")[0] == ref.split(",")[0]  # Prompt: N tokens / Generation: ...
    assert ours[5].startswith("Peak memory: ") and ours[5].endswith(" GB")


def test_generate_passes_mlx_lm_generate_options_on(monkeypatch, capsys):
    """Each of mlx_lm.generate's options reaches what mlx_lm.generate's main gives it:
    the sampler's XTC settings, stream_generate's cache and prefill options and the
    draft model (the tokens above cannot show that a flag was not dropped)."""
    import mlx_lm
    import mlx_lm.sample_utils

    from pyloader.default_model import default_model_path

    seen = {}
    real_make_sampler = mlx_lm.sample_utils.make_sampler

    def make_sampler(*args, **kwargs):
        seen["sampler"] = kwargs
        return real_make_sampler(*args, **kwargs)

    def stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        seen["generate"] = kwargs
        return iter(())

    monkeypatch.setattr(mlx_lm.sample_utils, "make_sampler", make_sampler)
    monkeypatch.setattr(mlx_lm, "stream_generate", stream_generate)
    model = str(default_model_path())
    assert main(["generate", model, "-p", "Hi", "-m", "2", "--xtc-probability", "0.5",
                 "--xtc-threshold", "0.2", "--max-kv-size", "24", "--prefill-step-size", "8",
                 "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "7",
                 "--draft-model", model, "--num-draft-tokens", "2"]) == 0
    assert (seen["sampler"]["xtc_probability"], seen["sampler"]["xtc_threshold"]) == (0.5, 0.2)
    g = seen["generate"]
    assert {k: g[k] for k in ("max_kv_size", "prefill_step_size", "kv_bits", "kv_group_size",
                              "quantized_kv_start", "num_draft_tokens")} == {
        "max_kv_size": 24, "prefill_step_size": 8, "kv_bits": 4, "kv_group_size": 32,
        "quantized_kv_start": 7, "num_draft_tokens": 2}
    assert g["draft_model"] is not None and "prompt_cache" not in g
    # Without the flags: mlx_lm.generate's defaults (0.32.2).
    assert main(["generate", model, "-p", "Hi", "-m", "2"]) == 0
    g = seen["generate"]
    assert ((g["max_kv_size"], g["prefill_step_size"], g["kv_bits"], g["kv_group_size"],
             g["quantized_kv_start"], g["draft_model"], g["num_draft_tokens"])
            == (None, 2048, None, 64, 5000, None, 3))
    assert (seen["sampler"]["xtc_probability"], seen["sampler"]["xtc_threshold"]) == (0.0, 0.1)
    capsys.readouterr()
    assert main(["generate", model, "-p", "Hi", "-m", "2", "--kv-prealloc",
                 "--kv-bits", "8"]) == 2
    assert "--kv-prealloc takes neither --max-kv-size nor --kv-bits" in capsys.readouterr().err


def test_generate_adapter_path_matches_mlx_lm_generate(tmp_path, capsys):
    """--adapter-path: a LoRA adapter on the default model's last two layers, those
    layers streamed (--resident 50%): mlx_lm.generate's text, which the adapter changes."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    from pyloader.default_model import default_model_path

    model_dir = str(default_model_path())
    skeleton, _ = load_model(Path(model_dir))
    params = {"rank": 4, "scale": 4.0, "dropout": 0.0}
    linear_to_lora_layers(skeleton, 2, params)
    mx.random.seed(11)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {
        k: 0.2 * mx.random.normal(v.shape).astype(v.dtype)
        for k, v in tree_flatten(skeleton.parameters())
        if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")})
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))
    flags = ["--model", model_dir, *FRANCE, "--adapter-path", str(adapter)]
    theirs = _mlx_lm_generate(flags).splitlines()
    assert main(["generate", *flags, "--resident", "50%"]) == 0
    ours = capsys.readouterr().out.splitlines()
    assert ours[:3] == theirs[:3] and "Paris" not in ours[1]  # the adapter changed it


def test_generate_help_lists_the_mlx_lm_flags_it_does_not_take(capsys):
    from pyloader.cli.generate import NOT_SUPPORTED

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    epilog = " ".join(text.split("not supported here")[1].split())
    assert [flag for flag, _ in NOT_SUPPORTED] == [
        "--image", "--prompt-cache-file", "--quantize-activations, -qa"]
    docs = " ".join((Path(__file__).parents[1] / "docs" / "generate.md").read_text().split())
    for flag, why in NOT_SUPPORTED:
        assert f"{flag}: {why}" in epilog
        assert f"* `{flag}`: " in docs, flag  # and the docs list it
    assert all(len(line) <= 100 for line in text.splitlines())


def test_generate_verbose_false_and_raw_prompt(capsys):
    from pyloader.default_model import default_model_path

    assert main(["generate", str(default_model_path()), "-p", "The capital of France is",
                 "-m", "3", "--ignore-chat-template", "--verbose", "False"]) == 0
    printed = capsys.readouterr()
    assert "Paris" in printed.out and "==========" not in printed.out
    assert "Prompt:" not in printed.out


def test_generate_ctrl_c_prints_the_stats_so_far():
    """SIGINT while generating: no traceback, the text so far, the statistics so far,
    exit status 130."""
    import signal

    from pyloader.default_model import default_model_path

    proc = subprocess.Popen(
        [sys.executable, "-m", "pyloader", "generate", str(default_model_path()), "-p",
         "Write a very long story about a dragon.", "-m", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
        # SIGINT at its default in the child even when this runs as a background job
        # (`cmd &` in a script ignores SIGINT, and Python keeps an ignored SIGINT ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        assert proc.stdout.readline() == "==========\n"
        proc.stdout.read(1)  # the first piece of generated text has been printed
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "[interrupted]" in out and "Generation: " in out and "tokens-per-sec" in out
    assert "pyloader: load" in err
    assert "INFO" not in err  # generate's --verbose (default True) is not `pyloader -v`


# ---------------------------------------------------------------------------- compare


def test_compare_table_columns_line_up_with_a_long_label():
    """A stream-experts@0.25 row (19 characters) used to push every later column of its
    row right of the header's."""
    from pyloader.compare.genbench import format_table

    def row(label):
        return {"strategy": label, "checkpoint": "m", "cache": "cold", "load_s": 0.1,
                "ttft_s": 1.0, "prompt_tps": 9.0, "decode_tps": 5.0, "peak_rss": 2**27,
                "expert_hit_rate": 0.5 if "experts" in label else None}

    report = {"summary": [row("mlx-lm"), row("stream-experts@0.25")], "runs": [],
              "cases": [], "runs_per_case": 1}
    lines = format_table(report).splitlines()
    header, rows = lines[1], lines[2:]
    for line in rows:
        for column in ("load s", "decode tok/s", "peak RSS"):
            start = header.index(column)
            assert line[start - 2:start] == "  " and line[start] != " ", (column, line)


def test_compare_refuses_an_ambiguous_stream_residency(tiny_llama, capsys):
    assert main(["compare", str(tiny_llama), "--strategies", "mlx-lm,stream",
                 "--resident", "0.5,1"]) == 2
    assert "write 1layer for one layer, or 100%" in capsys.readouterr().err


def test_compare_writes_under_the_cache_not_the_current_directory(tiny_llama, tmp_path,
                                                                  monkeypatch, capsys):
    monkeypatch.setenv("PYLOADER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    assert main(["compare", str(tiny_llama), "--strategies", "mlx-lm", "--kv", "default",
                 "--runs", "1", "--max-tokens", "2", "--no-plots"]) == 0
    assert set(os.listdir(tmp_path)) == before | {"cache"}  # nothing in the cwd
    written = list((tmp_path / "cache" / "compare").glob("*/results.json"))
    assert len(written) == 1
    assert f"results: {written[0].parent}/" in capsys.readouterr().out


def test_synthetic_models_print_in_units_and_no_quantization_print(tmp_path, monkeypatch,
                                                                    capsys):
    """The sizes print in units (was "30000000B"); mlx-lm's "[INFO] Quantized model ..."
    print does not reach the script's output."""
    from benchlib import synthetic
    from pyloader.compare.system import format_bytes

    monkeypatch.setattr(synthetic, "make_moe_model",
                        lambda path, size, seed, _real=synthetic.make_moe_model:
                        _real(path, size, num_experts=8, top_k=2, seed=seed))
    out = tmp_path / "moe"
    assert write_synthetic([str(out), "--model", "qwen3_moe", "--size", "30MB"]) == 0
    printed = capsys.readouterr()
    total = pyloader.open(out).total_nbytes
    assert "qwen3_moe, 1 shard, " in printed.out and format_bytes(total) in printed.out
    assert "Quantized" not in printed.out + printed.err


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_synthetic_dense_model_carries_a_tokenizer(arch, tmp_path, capsys):
    """The dense random-weight models are written with a tokenizer that load_model returns,
    so generation runs end to end on them; one written before tokenizers were (marker, no
    tokenizer files) gets one when reused."""
    import mlx_lm
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    path = tmp_path / arch
    assert write_synthetic([str(path), "--model", arch, "--size", "20MB"]) == 0
    assert (path / "tokenizer.json").is_file()
    model, tokenizer = pyloader.load_model(path, resident="50%")
    assert isinstance(tokenizer, TokenizerWrapper)
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"
    assert isinstance(mlx_lm.generate(model, tokenizer, "Hello", max_tokens=3), str)
    for f in path.glob("tokenizer*"):
        f.unlink()
    assert write_synthetic([str(path), "--model", arch, "--size", "20MB"]) == 0
    assert pyloader.load_model(path, tokenizer=True)[1] is not None
    capsys.readouterr()


def test_compare_shows_both_kernels(tiny_llama, tmp_path, capsys):
    """By default compare runs every loader with MLX's kernels and with pyloader's; the
    +kernels rows are checked against mlx-lm+kernels, and how mlx-lm+kernels compares
    with mlx-lm is reported."""
    out = tmp_path / "cmp"
    code = main(["compare", str(tiny_llama), "--strategies", "mlx-lm,pread", "--kv",
                 "default", "--runs", "1", "--max-tokens", "4", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    report = json.loads((out / "results.json").read_text())
    assert sorted(report["strategies"]) == sorted(
        ["mlx-lm", "pread", "mlx-lm+kernels", "pread+kernels"])
    assert [r["identical"] for r in report["runs"]] == [True] * 4
    assert "mlx-lm+kernels on" in printed.out
    assert "kernels_vs_mlx" in report


def test_compare_generation(tiny_llama, tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", str(tiny_llama), "--strategies", "mlx-lm,mmap,stream",
                 "--resident", "0", "--kv", "default,prealloc", "--runs", "1",
                 "--max-tokens", "4", "--kernels", "mlx", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    report = json.loads((out / "results.json").read_text())
    labels = ["mlx-lm", "mmap", "stream@0", "mlx-lm+kv", "mmap+kv", "stream@0+kv"]
    assert sorted(report["strategies"]) == sorted(labels)
    assert all("error" not in r for r in report["runs"])
    assert [r["identical"] for r in report["runs"]] == [True] * 6
    # Cold by default. (The header pages, read again to measure this, also hold the
    # first tensors: a few percent of a model this small.)
    assert all(r["page_cache_before"] < 0.25 for r in report["runs"])
    for r in report["runs"]:
        assert r["peak_rss"] > 0 and r["mx_peak"] > 0 and r["decode_tps"] > 0
        assert r["generated_tokens"] == 4
    stream = next(r for r in report["runs"] if r["strategy"] == "stream@0")
    assert stream["streamed_units"] == 2 and stream["passes"] >= 4
    assert all(t["samples"] for t in report["traces"])
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 6
    assert {s["strategy"] for s in report["summary"]} == set(labels)
    for label in labels:
        assert label in printed.out
    assert "same out" in printed.out and "[" in printed.err  # table on stdout, progress on stderr
    assert (out / "memory.png").stat().st_size > 0
    assert (out / "tps_vs_resident.png").stat().st_size > 0


def test_compare_flags_and_excludes_differing_runs():
    rows = [
        {"checkpoint": "m", "cache": "cold", "run": 0, "strategy": "mlx-lm", "bytes": 1,
         "decode_tps": 10.0, "total_s": 1.0, "tokens": [1, 2, 3], "text": "", "samples": []},
        {"checkpoint": "m", "cache": "cold", "run": 0, "strategy": "mmap", "bytes": 1,
         "decode_tps": 20.0, "total_s": 1.0, "tokens": [1, 2, 3], "text": "", "samples": []},
        {"checkpoint": "m", "cache": "cold", "run": 1, "strategy": "mmap", "bytes": 1,
         "decode_tps": 99.0, "total_s": 1.0, "tokens": [1, 5, 3], "text": "", "samples": []},
    ]
    report = {"runs": rows}
    genbench.finish(rows, report)
    assert [r["identical"] for r in rows] == [True, True, False]
    assert rows[2]["excluded"] and rows[2]["first_diff"] == 1
    summary = harness.summarize(rows, genbench.METRICS, genbench.BASELINE, genbench.STRATEGIES)
    mmap = next(s for s in summary if s["strategy"] == "mmap")
    assert mmap["runs"] == 1 and mmap["decode_tps"] == 20.0
    assert mmap["decode_tps_x_mlx-lm"] == 2.0


def test_compare_load_only(aligned_file, tmp_path, capsys):
    out = tmp_path / "load"
    assert main(["compare", str(aligned_file), "--load-only", "--strategies", "mlx,mmap",
                 "--warm", "--runs", "1", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["workload"] == "load"
    assert {r["strategy"] for r in report["runs"]} == {"mlx", "mmap"}
    mmap = next(r for r in report["runs"] if r["strategy"] == "mmap")
    assert mmap["zero_copy_fraction"] == 1.0
    assert "t_dict s" in capsys.readouterr().out


def test_compare_load_only_defaults_to_the_built_in_model_in_both_layouts(tmp_path, capsys):
    """Without a checkpoint, --load-only loads the built-in model as stored (aligned: views)
    and as mx.save_safetensors writes it (misaligned: counted copies), the same tensors."""
    from pyloader.cli.compare import mlx_written
    from pyloader.default_model import default_model_path

    stored = str(default_model_path())
    written = mlx_written(stored)
    assert mlx_written(stored) == written  # written once
    a, b = pyloader.load(stored), pyloader.load(written)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    out = tmp_path / "load"
    assert main(["compare", "--load-only", "--strategies", "mmap", "--warm", "--runs", "1",
                 "--out", str(out)]) == 0
    runs = {r["checkpoint"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert runs.keys() == {"default", "mlx-written"}
    assert runs["default"]["zero_copy_fraction"] == 1.0
    assert runs["mlx-written"]["zero_copy_fraction"] < 1.0
    capsys.readouterr()


def test_compare_bad_arguments(tiny_llama, aligned_file, capsys):
    assert main(["compare", str(tiny_llama), "--strategies", "mlx-lm,warp"]) == 2
    assert "unknown strategy warp" in capsys.readouterr().err
    assert main(["compare", str(aligned_file)]) == 2  # a bare file has no model config
    assert "--load-only" in capsys.readouterr().err
    assert main(["compare", str(tiny_llama), "--load-only", "--strategies", "stream"]) == 2
    assert main(["compare", str(tiny_llama), "--runs", "0"]) == 2


def test_commands_needing_mlx_lm_say_how_to_get_it(tiny_llama, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)
    assert main(["compare", str(tiny_llama)]) == 2
    assert 'pip install "pyloader-mlx[compare]"' in capsys.readouterr().err
    assert main(["generate", str(tiny_llama), "--prompt", "x"]) == 2
    assert "mlx-lm" in capsys.readouterr().err


def test_config_labels():
    cfg = genbench.Config.parse("stream@0.25+kv")
    assert (cfg.strategy, cfg.resident, cfg.kv) == ("stream", "0.25", "prealloc")
    assert cfg.label == "stream@0.25+kv" and cfg.resident_fraction == 0.25
    assert genbench.Config.parse("stream@3").resident_fraction is None  # a layer count
    for bad in ("stream", "mmap@0.5", "turbo"):
        with pytest.raises(ValueError):
            genbench.Config.parse(bad)
    labels = genbench.configurations(["mmap", "mlx-lm", "stream"], ["0.5", "0"],
                                     ["default", "prealloc"])
    assert labels[0] == "mlx-lm" and len(labels) == 8 and "stream@0+kv" in labels


def test_thin_keeps_ends_and_spacing():
    samples = [(i, i) for i in range(1001)]
    kept = genbench.thin(samples, 100)
    assert kept[0] == samples[0] and kept[-1] == samples[-1]
    assert 90 <= len(kept) <= 102
    assert genbench.thin(samples[:50], 100) == samples[:50]


def test_plots_need_matplotlib(monkeypatch):
    from pyloader.compare import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(pyloader.errors.PlotsUnavailable, match="pip install"):
        plots.plot_report({"summary": []}, os.devnull)


def test_a_closed_output_pipe_ends_quietly():
    """`pyloader ... | head`: the reader closed the pipe before the command wrote; the
    command stops with SIGPIPE's status and no traceback (before: BrokenPipeError)."""
    proc = subprocess.Popen([sys.executable, "-m", "pyloader", "launch", "-h"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with proc:
        proc.stdout.close()  # long before the interpreter has started and printed
        err = proc.stderr.read().decode()
        status = proc.wait(timeout=60)
    assert status == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
