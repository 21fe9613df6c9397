"""convert_gguf on hostile metadata and tensors: one case per rule of
pyloader/io/gguf_checks.py and pyloader/io/gguf_source.py, each a tiny llama (tests/gguf_files.py) with one value or
tensor changed. Each is refused with a typed error naming the file, the key or tensor and
the rule, before anything is written; ``pyloader convert-gguf`` reports it in one line and
exits 1, never with a traceback."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf_files import tiny_llama_gguf

import pyloader
from pyloader.cli import main
from pyloader.gguf import convert_gguf


def u32(v):
    return mx.array(v, dtype=mx.uint32)


def f32(*shape):
    return mx.zeros(shape, dtype=mx.float32)


FORMAT, UNSUPPORTED = pyloader.FormatError, pyloader.UnsupportedError

# (id, metadata overrides, tensor overrides, error type, fragments of the message)
CASES = [
    ("head-count-0", {"llama.attention.head_count": u32(0)}, {}, FORMAT,
     ["'llama.attention.head_count'", "0 is not an integer from 1"]),
    ("head-count-kv-0", {"llama.attention.head_count_kv": u32(0)}, {}, FORMAT,
     ["'llama.attention.head_count_kv'", "0 is not an integer from 1"]),
    ("heads-not-a-multiple", {"llama.attention.head_count_kv": u32(3)}, {}, FORMAT,
     ["head_count_kv", "4 query heads are not a multiple of 3"]),
    ("heads-do-not-divide-the-width", {"llama.attention.head_count": u32(3),
                                       "llama.attention.head_count_kv": u32(3)}, {}, FORMAT,
     ["head_count", "3 heads do not divide the width 64"]),
    ("block-count-an-array", {"llama.block_count": u32([2, 2])}, {}, FORMAT,
     ["'llama.block_count'", "array[uint32] value where an integer belongs"]),
    ("block-count-a-string", {"llama.block_count": "2"}, {}, FORMAT,
     ["'llama.block_count'", "string value where an integer belongs"]),
    ("block-count-a-float", {"llama.block_count": mx.array(2.0)}, {}, FORMAT,
     ["'llama.block_count'", "float32 value where an integer belongs"]),
    ("context-length-negative", {"llama.context_length": mx.array(-1, dtype=mx.int32)}, {},
     FORMAT, ["'llama.context_length'", "-1 is not an integer from 1"]),
    ("key-length-odd", {"llama.attention.key_length": u32(15)}, {}, FORMAT,
     ["'llama.attention.key_length'", "head size 15 is odd"]),
    ("freq-base-nan", {"llama.rope.freq_base": mx.array(float("nan"))}, {}, FORMAT,
     ["'llama.rope.freq_base'", "nan is not a finite positive number"]),
    ("freq-base-inf", {"llama.rope.freq_base": mx.array(float("inf"))}, {}, FORMAT,
     ["'llama.rope.freq_base'", "inf is not a finite positive number"]),
    ("rms-eps-negative", {"llama.attention.layer_norm_rms_epsilon": mx.array(-1e-6)}, {},
     FORMAT, ["'llama.attention.layer_norm_rms_epsilon'", "is not a finite positive"]),
    ("rms-eps-zero", {"llama.attention.layer_norm_rms_epsilon": mx.array(0.0)}, {}, FORMAT,
     ["'llama.attention.layer_norm_rms_epsilon'", "0.0 is not a finite positive"]),
    ("rope-scaling-factor-nan", {"llama.rope.scaling.type": "linear",
                                 "llama.rope.scaling.factor": mx.array(float("nan"))}, {},
     FORMAT, ["'llama.rope.scaling.factor'", "not a finite positive"]),
    ("architecture-a-number", {"general.architecture": u32(1)}, {}, FORMAT,
     ["'general.architecture'", "uint32 value where a string belongs"]),
    ("name-an-array", {"general.name": u32([1, 2])}, {}, FORMAT,
     ["'general.name'", "where a string belongs"]),
    ("unknown-token-id-out-of-range", {"tokenizer.ggml.unknown_token_id": u32(1000)}, {},
     FORMAT, ["'tokenizer.ggml.unknown_token_id'",
              "token id 1000 is outside the vocabulary of 32 tokens"]),
    ("bos-token-id-out-of-range", {"tokenizer.ggml.bos_token_id": u32(32)}, {}, FORMAT,
     ["'tokenizer.ggml.bos_token_id'", "token id 32 is outside"]),
    ("eos-token-id-negative", {"tokenizer.ggml.eos_token_id": mx.array(-1, dtype=mx.int32)},
     {}, FORMAT, ["'tokenizer.ggml.eos_token_id'", "-1 is not an integer from 0"]),
    ("tokens-as-integers", {"tokenizer.ggml.tokens": mx.arange(32, dtype=mx.int32)}, {},
     FORMAT, ["'tokenizer.ggml.tokens'", "array[int32] value where an array of strings"]),
    ("merges-as-integers", {"tokenizer.ggml.merges": mx.array([1, 2], dtype=mx.int32)}, {},
     FORMAT, ["'tokenizer.ggml.merges'", "array[int32] value where an array of strings"]),
    ("merge-of-unknown-tokens", {"tokenizer.ggml.merges": ["Ġ a", "q é"]}, {}, FORMAT,
     ["'tokenizer.ggml.merges'", "merge 'q é' names 'é', which is not a token"]),
    ("merge-whose-result-is-unknown", {"tokenizer.ggml.merges": ["a c"]}, {}, FORMAT,
     ["'tokenizer.ggml.merges'", "merge 'a c' names 'ac', which is not a token"]),
    ("merge-of-three", {"tokenizer.ggml.merges": ["a b c"]}, {}, FORMAT,
     ["'tokenizer.ggml.merges'", "is not two tokens separated by one space"]),
    ("token-types-as-strings", {"tokenizer.ggml.token_type": ["1"] * 32}, {}, FORMAT,
     ["'tokenizer.ggml.token_type'", "array[string] value where an array of integers"]),
    ("token-types-too-few", {"tokenizer.ggml.token_type": mx.ones((3,), dtype=mx.int32)}, {},
     FORMAT, ["'tokenizer.ggml.token_type'", "3 entries for 32 tokens"]),
    ("add-bos-a-string", {"tokenizer.ggml.add_bos_token": "yes"}, {}, FORMAT,
     ["'tokenizer.ggml.add_bos_token'", "string value where a bool belongs"]),
    ("chat-template-a-number", {"tokenizer.chat_template": u32(7)}, {}, FORMAT,
     ["'tokenizer.chat_template'", "uint32 value where a string belongs"]),
    ("no-tokens", {"tokenizer.ggml.tokens": None}, {}, FORMAT,
     ["has no 'tokenizer.ggml.tokens'"]),
    # Tensors against the metadata.
    ("float-tensors-named-like-quantized-parts", {},
     {"blk.0.attn_q.scales": f32(64, 2), "blk.0.attn_q.biases": f32(64, 2)}, UNSUPPORTED,
     ["tensor 'blk.0.attn_q.scales' has no mlx-lm counterpart"]),
    ("a-float-tensor-named-scales", {}, {"blk.1.ffn_up.scales": f32(96, 2)}, UNSUPPORTED,
     ["tensor 'blk.1.ffn_up.scales' has no mlx-lm counterpart"]),
    ("width-disagrees", {"llama.embedding_length": u32(32)}, {}, FORMAT,
     ["'llama.embedding_length'", "width 32, but token_embd.weight is (32, 64)"]),
    ("feed-forward-disagrees", {"llama.feed_forward_length": u32(128)}, {}, FORMAT,
     ["tensor 'blk.1.ffn_down.weight': shape (64, 96), but the metadata makes it "
      "(64, 128)"]),
    ("key-length-disagrees", {"llama.attention.key_length": u32(8),
                              "llama.attention.value_length": u32(8)}, {}, FORMAT,
     ["tensor 'blk.1.attn_output.weight': shape (64, 64), but the metadata makes it "
      "(64, 32)"]),
    ("output-vocabulary-disagrees", {}, {"output.weight": f32(31, 64)}, FORMAT,
     ["tensor 'output.weight': shape (31, 64)", "(32, 64)"]),
    ("a-norm-of-two-dimensions", {}, {"blk.1.attn_norm.weight": f32(1, 64)}, FORMAT,
     ["tensor 'blk.1.attn_norm.weight': shape (1, 64)", "(64,)"]),
    ("block-beyond-the-count", {}, {"blk.2.attn_q.weight": f32(64, 64)}, FORMAT,
     ["tensor 'blk.2.attn_q.weight' is beyond block_count=2"]),
    ("block-number-with-a-leading-zero", {}, {"blk.01.attn_q.weight": f32(64, 64)}, FORMAT,
     ["tensor 'blk.01.attn_q.weight'", "'01' is not a block number"]),
    ("block-number-not-ascii", {}, {"blk.١.attn_q.weight": f32(64, 64)}, FORMAT,
     ["'١' is not a block number"]),
    ("a-block-without-its-value-projection", {}, {"blk.1.attn_v.weight": None}, FORMAT,
     ["no tensor 'blk.1.attn_v.weight', which mlx-lm's llama model has"]),
    ("attention-bias-in-one-block-only", {}, {"blk.0.attn_q.bias": f32(64)}, FORMAT,
     ["no tensor 'blk.0.attn_k.bias', which mlx-lm's llama model has (7 missing)"]),
    ("a-feed-forward-bias", {}, {"blk.0.ffn_up.bias": f32(96)}, UNSUPPORTED,
     ["tensor 'blk.0.ffn_up.bias' has no parameter in mlx-lm's llama model"]),
    ("a-tensor-without-a-suffix", {}, {"blk.0.attn_q": f32(64)}, UNSUPPORTED,
     ["tensor 'blk.0.attn_q' has no mlx-lm counterpart"]),
    ("vocabulary-larger-than-the-embedding", {},
     {"token_embd.weight": f32(31, 64), "output.weight": f32(31, 64)}, FORMAT,
     ["'tokenizer.ggml.tokens'", "32 tokens but an embedding of 31 rows"]),
]


@pytest.mark.parametrize("meta,tensors,error,fragments",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_values_are_refused_before_anything_is_written(tmp_path, meta, tensors, error,
                                                               fragments):
    src = tiny_llama_gguf(tmp_path / "hostile.gguf", {}, tensors=tensors, **meta)
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        convert_gguf(src, out)
    text = str(info.value)
    assert type(info.value) is error and text.startswith(f"{src}: "), text
    for fragment in fragments:
        assert fragment in text, text
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


@pytest.mark.parametrize("case", ["head-count-0", "block-count-an-array",
                                  "unknown-token-id-out-of-range", "merges-as-integers",
                                  "float-tensors-named-like-quantized-parts",
                                  "freq-base-nan"])
def test_the_cli_reports_a_hostile_file_in_one_line(tmp_path, capsys, case):
    _, meta, tensors, error, fragments = next(c for c in CASES if c[0] == case)
    src = tiny_llama_gguf(tmp_path / "hostile.gguf", {}, tensors=tensors, **meta)
    assert main(["convert-gguf", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pyloader convert-gguf: {error.__name__}: {src}: ")
    assert "Traceback" not in err and err.count("\n") == 1 and fragments[-1] in err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_error_the_checks_do_not_foresee_names_the_keys(tmp_path, monkeypatch):
    """Any other exception from the tokenizers library becomes a FormatError naming the
    metadata it was building from."""
    from tokenizers import models

    def refuse(*args, **kwargs):
        raise Exception("Error while initializing BPE")  # noqa: TRY002 - the library's type

    monkeypatch.setattr(models, "BPE", refuse)
    src = tiny_llama_gguf(tmp_path / "t.gguf", {})
    with pytest.raises(pyloader.FormatError) as info:
        convert_gguf(src, tmp_path / "out")
    text = str(info.value)
    assert text.startswith(f"{src}: metadata tokenizer.ggml.tokens and tokenizer.ggml.merges")
    assert "Error while initializing BPE" in text
    assert not (tmp_path / "out").exists()


def test_checked_values_reach_the_config(tmp_path):
    """What the checks let through is written as it was: an explicit key length with
    biases in every attention projection, a float32 epsilon as its shortest decimal."""
    biases = {f"blk.{i}.{n}.bias": f32(m) for i in range(2)
              for n, m in (("attn_q", 64), ("attn_k", 32), ("attn_v", 32),
                           ("attn_output", 64))}
    src = tiny_llama_gguf(tmp_path / "t.gguf", {}, tensors=biases,
                          **{"llama.attention.key_length": u32(16),
                             "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
                             "tokenizer.ggml.unknown_token_id": u32(31)})
    out = convert_gguf(src, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] is True and config["head_dim"] == 16
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special["unk_token"] == "ab"
    w = mx.load(str(out / "model.safetensors"))
    assert np.array_equal(np.array(w["model.layers.1.self_attn.o_proj.bias"]), np.zeros(64))
