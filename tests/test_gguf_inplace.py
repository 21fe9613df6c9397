"""GGUF files loaded in place: ``load_model("x.gguf")`` computes llama.cpp's block formats as
they lie in the file, with the logits of mlx-lm's model over the exact float weights."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import pyloader
from pyloader.errors import FormatError, UnsupportedError
from pyloader.gguf import convert_gguf, unpermute_qk_rows
from pyloader.io.gguf_header import read_header

from gguf_inplace_files import BLOCK_TYPES, EXPERTS, SIZES, write_model

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = mx.array([[1, 5, 9, 30, 31, 7, 200, 3]])
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_BY_ARCH = {
    "phi3": {**_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma3_text": {**_BLOCK, "post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"},
}
_BY_ARCH["gemma2"] = _BY_ARCH["gemma3_text"]
for _arch, _moe in (("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")):
    _BY_ARCH[_arch] = {**_BLOCK, "ffn_gate_inp": f"{_moe}.gate",
                       **{f"ffn_{p}_exps": f"{_moe}.switch_mlp.{p}_proj"
                          for p in ("gate", "up", "down")}}


def reference_model(arch: str, exact: dict[str, np.ndarray], **config_overrides):
    """mlx-lm's ``arch`` model over the exact float32 weights, Q/K rows in Hugging Face order
    (llama.cpp permutes a llama's), with MLX's own ops."""
    s = {**SIZES, "n_layer": config_overrides.pop("n_layer", SIZES["n_layer"])}
    config = {"model_type": arch, "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
              "num_hidden_layers": s["n_layer"], "num_attention_heads": s["n_head"],
              "num_key_value_heads": s["n_kv"], "head_dim": s["head_dim"],
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "vocab_size": exact["token_embd.weight"].shape[0],
              "tie_word_embeddings": "output.weight" not in exact, **config_overrides}
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {}
    for name, value in exact.items():
        base, part = name.rsplit(".", 1)
        if base in _GLOBAL:
            target = _GLOBAL[base]
        else:
            _, i, kind = base.split(".")
            target = f"model.layers.{i}.{_BY_ARCH.get(arch, _BLOCK)[kind]}"
        if arch in ("gemma2", "gemma3_text") and kind_of(base).endswith("norm"):
            value = value.astype(np.float64) - 1  # mlx-lm's gemma multiplies by 1 + weight
        v = mx.array(value.astype(np.float32))
        if arch in ("llama", "mixtral") and kind_of(base) in ("attn_q", "attn_k"):
            v = unpermute_qk_rows(v, s["n_head"] if kind_of(base) == "attn_q" else s["n_kv"])
        weights[f"{target}.{part}"] = v
    if hasattr(model, "sanitize"):  # as mlx_lm.load does
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    return model


def kind_of(base: str) -> str:
    return base.rsplit(".", 1)[-1]


def logits(model) -> np.ndarray:
    out = model(PROMPT)
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def check_close(got: np.ndarray, want: np.ndarray) -> None:
    # float32 everywhere; only the order of the sums differs (and the Q/K head-dim order)
    scale = np.abs(want).max()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("linear", BLOCK_TYPES + ("F16", "F32"))
def test_llama_every_format(tmp_path, linear):
    exact = write_model(tmp_path / "m.gguf", "llama", linear, embed=linear)
    model, tok = pyloader.load_model(tmp_path / "m.gguf", kernels="auto")
    check_close(logits(model), logits(reference_model("llama", exact)))
    assert tok is not None and tok.eos_token_id == 2


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("linear", ["Q4_K", "Q6_K", "Q8_0"])
def test_architectures(tmp_path, arch, linear):
    exact = write_model(tmp_path / "m.gguf", arch, linear, embed="Q4_K", tied=True)
    model, _ = pyloader.load_model(tmp_path / "m.gguf", kernels="auto")
    check_close(logits(model), logits(reference_model(arch, exact)))


@pytest.mark.parametrize("linear", ["Q4_K", "Q5_K", "Q8_0"])
def test_phi3_fused_projections_and_partial_rope(tmp_path, linear):
    """phi3's fused Q/K/V and gate/up matrices computed in place, RoPE over half a head."""
    exact = write_model(tmp_path / "m.gguf", "phi3", linear, embed="Q6_K", rope_dim=32)
    model, _ = pyloader.load_model(tmp_path / "m.gguf", kernels="auto")
    assert type(model).__module__ == "mlx_lm.models.phi3"
    assert model.layers[0].self_attn.rope.dims == 32
    check_close(logits(model), logits(reference_model("phi3", exact,
                                                      partial_rotary_factor=0.5)))


@pytest.mark.parametrize("linear", ["Q4_K", "Q6_K"])
def test_gemma3_stored_norms_and_sliding_window(tmp_path, linear):
    """gemma3: norms as stored (1 + mlx-lm's weight), layers 0-4 in a sliding window of 4
    and layer 5 global, the tied embedding scaled by sqrt(width), gelu; the prompt is longer
    than the window."""
    exact = write_model(tmp_path / "m.gguf", "gemma3", linear, embed="Q8_0", tied=True,
                        sizes={"n_layer": 6})
    model, _ = pyloader.load_model(tmp_path / "m.gguf", kernels="auto")
    assert type(model).__module__ == "mlx_lm.models.gemma3_text"
    want = reference_model("gemma3_text", exact, n_layer=6, sliding_window=4,
                           sliding_window_pattern=6, query_pre_attn_scalar=SIZES["head_dim"],
                           rope_local_base_freq=10000.0)
    check_close(logits(model), logits(want))
    if linear == "Q4_K":  # a format MLX's own ops compute exactly
        model, _ = pyloader.load_model(tmp_path / "m.gguf", kernels="mlx")
        check_close(logits(model), logits(want))
    # The window matters: the same model attending globally gives other logits.
    assert not np.allclose(logits(model), logits(reference_model(
        "gemma3_text", exact, n_layer=6, sliding_window=64, sliding_window_pattern=6,
        query_pre_attn_scalar=SIZES["head_dim"])), atol=1e-3)


#: mlx-lm's config of the mixtures :data:`EXPERTS` describes.
_MOE_CONFIG = {
    "qwen3_moe": {"num_experts": EXPERTS["n_expert"], "num_experts_per_tok": EXPERTS["n_used"],
                  "moe_intermediate_size": EXPERTS["expert_ffn"], "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True},
    "mixtral": {"num_local_experts": EXPERTS["n_expert"],
                "num_experts_per_tok": EXPERTS["n_used"],
                "intermediate_size": EXPERTS["expert_ffn"]},
}


@pytest.mark.parametrize("arch, model_type", [("qwen3moe", "qwen3_moe"), ("llama", "mixtral")])
@pytest.mark.parametrize("linear", ["Q4_K", "Q6_K", "Q8_0", "F16"])
def test_mixture_of_experts(tmp_path, arch, model_type, linear):
    """qwen3moe and mixtral (a llama with experts): the router and the experts' stacked
    matrices computed in place, each token through the experts it is routed to."""
    path = tmp_path / "m.gguf"
    exact = write_model(path, arch, linear, embed="Q8_0", experts=True, seed=3)
    model, _ = pyloader.load_model(path, kernels="auto")
    assert type(model).__module__ == f"mlx_lm.models.{model_type}"
    want = reference_model(model_type, exact, **_MOE_CONFIG[model_type])
    check_close(logits(model), logits(want))
    # A prompt long enough for mlx-lm's sorted routing (64 and more token-expert pairs).
    long = mx.array([[(7 * i + 3) % 256 for i in range(40)]])
    check_close(np.array(model(long)), np.array(want(long)))
    if linear in ("Q8_0", "F16"):  # formats MLX's own ops compute exactly
        model, _ = pyloader.load_model(path, kernels="mlx")
        layer = model.model.layers[0]
        moe = layer.mlp if arch == "qwen3moe" else layer.block_sparse_moe
        assert type(moe.switch_mlp.gate_proj).__name__ == (
            "QuantizedSwitchLinear" if linear == "Q8_0" else "SwitchLinear")
        check_close(logits(model), logits(want))


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_experts_stream_from_the_file(tmp_path, arch):
    """Layers streamed, and only the routed experts read into slot banks (pread) or served
    from the page cache (mmap): the resident model's logits, bit for bit."""
    path = tmp_path / "m.gguf"
    write_model(path, arch, "Q4_K", embed="Q8_0", experts=True, seed=5, sizes={"n_layer": 3})
    resident, _ = pyloader.load_model(path, tokenizer=False, kernels="auto")
    want = logits(resident)
    for kw in ({"resident": 0},
               {"options": pyloader.StreamOptions(experts=2)},
               {"resident": 0, "options": pyloader.StreamOptions(experts=1, expert_policy="lfu")},
               {"options": pyloader.StreamOptions(experts=1, expert_source="mmap")}):
        model, _ = pyloader.load_model(path, tokenizer=False, kernels="auto", **kw)
        assert np.array_equal(logits(model), want), kw
        if "options" in kw:
            ex = pyloader.stats(model)["experts"]["total"]
            assert ex["misses"] > 0 and ex["bytes_read"] > 0, (kw, ex)
    with pytest.raises(ValueError, match="experts cannot stream"):
        pyloader.load_model(path, kernels="mlx", options=pyloader.StreamOptions(experts=1))


def test_experts_stored_one_by_one_are_refused(tmp_path):
    """Early mixtral GGUFs hold each expert's matrices apart (blk.N.ffn_gate.E.weight)."""
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0", experts=True,
                types={"blk.0.ffn_gate_exps.weight": "Q8_0"})
    header = read_header(path)
    assert "blk.0.ffn_gate_exps.weight" in header.tensors
    import gguf

    old = tmp_path / "old.gguf"
    w = gguf.GGUFWriter(str(old), "llama")
    reader = gguf.GGUFReader(str(path))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        name = t.name.replace("ffn_gate_exps", "ffn_gate.0")
        w.add_tensor(name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedError, match=r"blk\.0\.ffn_gate\.0\.weight.*stacked"):
        pyloader.load_model(old)


def test_gemma3_with_fewer_layers_than_its_pattern_is_refused(tmp_path):
    write_model(tmp_path / "m.gguf", "gemma3", "Q8_0", tied=True)  # 2 blocks
    with pytest.raises(UnsupportedError, match="gemma3.block_count"):
        pyloader.load_model(tmp_path / "m.gguf")


def test_gemma2_soft_caps(tmp_path):
    """gemma2: norms as stored, the file's soft caps on attention scores and logits."""
    exact = write_model(tmp_path / "m.gguf", "gemma2", "Q5_K", embed="Q8_0", tied=True)
    model, _ = pyloader.load_model(tmp_path / "m.gguf", kernels="auto")
    assert type(model).__module__ == "mlx_lm.models.gemma2"
    got = logits(model)
    assert np.abs(got).max() <= 8.0  # capped at 8
    caps = {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 8.0,
            "query_pre_attn_scalar": SIZES["head_dim"]}
    check_close(got, logits(reference_model("gemma2", exact, **caps)))
    # The attention cap matters: mlx-lm's default of 50 gives other logits.
    assert not np.allclose(got, logits(reference_model(
        "gemma2", exact, **{**caps, "attn_logit_softcapping": 50.0})), atol=1e-3)


@pytest.mark.parametrize("rope_dim, error", [(31, FormatError), (0, FormatError)])
def test_phi3_rotary_dimensions_are_checked(tmp_path, rope_dim, error):
    write_model(tmp_path / "m.gguf", "phi3", "Q8_0", rope_dim=rope_dim)
    with pytest.raises(error, match="rope.dimension_count"):
        pyloader.load_model(tmp_path / "m.gguf")


def test_weights_are_the_file_bytes(tmp_path):
    """The block tensors are the file's bytes (views of the mapping), not a converted copy."""
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q4_K", embed="Q6_K")
    model, _ = pyloader.load_model(path, tokenizer=False, kernels="auto")
    header = read_header(path)
    raw = np.fromfile(path, dtype=np.uint8)
    t = header.tensors["blk.1.ffn_down.weight"]
    w = model.model.layers[1].mlp.down_proj.weight
    assert w.dtype == mx.uint8
    assert np.array_equal(np.array(w).reshape(-1), raw[t.offset:t.offset + t.nbytes])


def test_streamed_equals_resident(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, "qwen3", "Q5_K", embed="Q8_0")
    resident, _ = pyloader.load_model(path, tokenizer=False, kernels="auto")
    streamed, _ = pyloader.load_model(path, tokenizer=False, resident="1layers",
                                      kernels="auto")
    assert pyloader.stats(streamed)["streamed_units"] >= 1
    assert np.array_equal(logits(streamed), logits(resident))


def test_a_file_without_a_tokenizer_has_none(tmp_path):
    """As a model directory without tokenizer files: the model, and None."""
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0", tokenizer={"tokenizer.ggml.model": "none"})
    model, tok = pyloader.load_model(path, kernels="auto")
    assert tok is None and len(model.model.layers) == SIZES["n_layer"]


def test_tokenizer_from_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0")
    _, tok = pyloader.load_model(path, kernels="auto")
    ids = tok.encode("ab a", add_special_tokens=False)
    assert tok.decode(ids) == "ab a"
    assert tok.convert_ids_to_tokens(ids)[:1] == ["ab"]


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0")
    data = bytearray(path.read_bytes())
    arch_at = data.index(b"llama", data.index(b"general.architecture"))
    data[arch_at:arch_at + 5] = b"falco"
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match="falco"):
        pyloader.load_model(path, kernels="auto")


def test_type_not_computed_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0", types={"blk.1.ffn_up.weight": "IQ4_NL"})
    with pytest.raises(UnsupportedError, match=r"blk\.1\.ffn_up\.weight.*IQ4_NL"):
        pyloader.load_model(path, kernels="auto")
    with pytest.raises(UnsupportedError, match=r"blk\.1\.ffn_up\.weight.*IQ4_NL"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _set_u32(path: Path, key: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key) + 4  # the key, then its uint32 type
    data[at:at + 4] = value.to_bytes(4, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("key, value, rule", [
    ("llama.feed_forward_length", 256, "tensor 'blk.0.ffn_gate.weight': shape"),
    # fuzzer findings: mlx-lm's own objects would be this size (MemoryError, OverflowError)
    ("llama.block_count", 2**32 - 1, "'llama.block_count': 4294967295 blocks"),
    ("llama.feed_forward_length", 2**32 - 1, "metadata makes it"),
])
def test_sizes_are_checked_against_the_tensors(tmp_path, key, value, rule):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0")
    _set_u32(path, key, value)
    with pytest.raises(FormatError, match=rule):
        pyloader.load_model(path, kernels="auto")


@pytest.mark.parametrize("linear", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                    "F16"])
def test_mlx_ops_exact_formats(tmp_path, linear):
    """kernels="mlx": the formats MLX computes exactly become MLX's affine arrays, with the
    exact weights (equal values; the sign of a zero may differ)."""
    from pyloader.io.gguf_affine import AFFINE_TYPES

    path = tmp_path / "m.gguf"
    exact = write_model(path, "qwen3", linear, embed=linear)
    model, _ = pyloader.load_model(path, kernels="mlx")
    check_close(logits(model), logits(reference_model("qwen3", exact)))
    layer = model.model.layers[0].mlp.up_proj
    if linear in AFFINE_TYPES:
        w = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32,
                          bits=AFFINE_TYPES[linear])
        assert np.array_equal(np.array(w), exact["blk.0.ffn_up.weight"])


@pytest.mark.parametrize("linear", ["Q2_K", "Q3_K", "Q6_K"])
def test_mlx_ops_refuse_other_formats(tmp_path, linear):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", linear)
    with pytest.raises(UnsupportedError, match=f"{linear}.*requantiz"):
        pyloader.load_model(path, kernels="mlx")


def test_mlx_ops_do_not_stream(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q4_K")
    with pytest.raises(ValueError, match="cannot stream"):
        pyloader.load_model(path, kernels="mlx", resident="1layers")


def _sentencepiece_vocab(tmp_path):
    """A SentencePiece BPE model trained on this repository's docs with llama's settings (no
    normalization, spaces kept, digits split, byte fallback), as GGUF metadata, and the
    SentencePiece processor (the reference)."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join((REPO_ROOT / "docs" / n).read_text()
                              for n in ("architecture.md", "streaming.md", "kernels.md")))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=700, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2,
                                   normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    meta = {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
            "tokenizer.ggml.token_type": kinds,
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(),
            "tokenizer.ggml.add_bos_token": True}
    return meta, sp


def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path):
    """A 'llama' (SentencePiece) vocabulary: the ids SentencePiece itself gives, on real text
    with words outside the training text (byte fallback), and the text back."""
    meta, sp = _sentencepiece_vocab(tmp_path)
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0", tokenizer=meta)
    _, tok = pyloader.load_model(path, kernels="auto")
    text = (REPO_ROOT / "README.md").read_text() + "\nÜber naïve café — 東京 3.14159 ✓\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tok.encode("Hello") == [sp.bos_id()] + sp.encode("Hello")
    assert tok.decode(ids) == sp.decode(ids)


@pytest.mark.parametrize("pre, digits", [("qwen2", ["1", "2", "3", "4"]),
                                         ("llama-bpe", ["123", "4"])])
def test_byte_level_pre_tokenizers(tmp_path, pre, digits):
    """Qwen2's and Llama 3's splits: digits one by one, or in threes."""
    path = tmp_path / "m.gguf"
    tokens = ["<s>", "</s>"] + [str(d) for d in range(10)] + ["123", "Ġx"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["1 2", "12 3"],
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
            "tokenizer.ggml.eos_token_id": 1}
    tokens.insert(-1, "12")
    meta["tokenizer.ggml.token_type"].append(1)
    write_model(path, "qwen2", "Q8_0", tokenizer=meta)
    _, tok = pyloader.load_model(path, kernels="auto")
    assert tok.convert_ids_to_tokens(tok.encode("1234", add_special_tokens=False)) == digits


def test_llama3_rope_factors(tmp_path):
    """``rope_freqs.weight`` (how llama.cpp stores Llama 3.1's RoPE scaling): the logits of
    mlx-lm's llama with that ``rope_scaling``."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    hd = SIZES["head_dim"]
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    freqs = np.array(Llama3RoPE(hd, 512, False, 10000.0, scaling)._freqs, np.float64)
    factors = freqs / 10000.0 ** (np.arange(0, hd, 2) / hd)
    assert factors.max() > 1.5  # the scaling changes some pairs
    path = tmp_path / "m.gguf"
    exact = write_model(path, "llama", "Q8_0", rope_factors=factors)
    model, _ = pyloader.load_model(path, kernels="auto")
    want = logits(reference_model("llama", exact, rope_scaling=scaling))
    check_close(logits(model), want)
    plain = logits(reference_model("llama", exact))
    assert np.abs(plain - want).max() > 100 * 2e-5 * np.abs(want).max()  # the test can fail


_RSS_CHILD = """
import sys, mlx.core as mx, pyloader
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
before = rss("RssAnon")
model, _ = pyloader.load_model(sys.argv[1], kernels="auto", tokenizer=False)
mx.eval(model(mx.array([[1, 2, 3]])))
print(rss("RssAnon") - before, rss("RssFile"))
"""


def test_resident_load_maps_instead_of_copying(tmp_path):
    """A resident load of a 270 MB file adds little anonymous memory: the weights are the
    page cache's pages (file-backed), not a copy."""
    import subprocess
    import sys

    path = tmp_path / "m.gguf"
    write_model(path, "llama", "F16", embed="Q8_0",
                sizes={"hidden": 1024, "ffn": 4096, "n_layer": 8, "head_dim": 128,
                       "n_head": 8, "n_kv": 4})
    size = path.stat().st_size
    assert size > 250e6
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYLOADER_KERNELS": "auto"})
    anon, file_backed = map(int, out.stdout.split())
    assert anon < 0.15 * size, (anon, size)
    assert file_backed > 0.9 * size, (file_backed, size)


def test_generate_command_takes_a_gguf_file(tmp_path, capsys):
    from pyloader.cli import main

    path = tmp_path / "m.gguf"
    write_model(path, "qwen3", "Q4_K", embed="Q6_K")
    assert main(["generate", str(path), "-p", "ab a", "--max-tokens", "3",
                 "--kernels", "auto"]) == 0
    assert "generated 3 tokens" in capsys.readouterr().err


def test_compare_takes_a_gguf_file(tmp_path):
    """``pyloader compare x.gguf``: each strategy in a fresh process against the file mapped
    and computed in place (mlx-lm does not read GGUF files), tokens checked run by run."""
    import json
    import subprocess
    import sys

    path = tmp_path / "m.gguf"
    write_model(path, "qwen3moe", "Q4_K", embed="Q8_0", experts=True, seed=2)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pyloader", "compare", str(path), "--runs", "1", "--kv",
           "default", "--warm", "--no-plots", "--out", str(out), "--max-tokens", "6"]
    proc = subprocess.run([*cmd, "--strategies", "mmap,pread,stream", "--resident", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    assert report["baseline"] == "mmap+kernels"
    runs = {r["strategy"]: r for r in report["runs"]}
    assert set(runs) == {"mmap+kernels", "pread+kernels", "stream@0+kernels"}
    assert all(r["identical"] is True for r in runs.values()), runs
    assert "same out" in proc.stdout and "x base: decode tok/s / mmap+kernels's" in proc.stdout
    refused = subprocess.run([*cmd, "--strategies", "mlx-lm,mmap"], capture_output=True,
                             text=True, timeout=600)
    assert refused.returncode == 2  # a usage error
    assert "mlx-lm does not read GGUF files" in refused.stderr


# --------------------------------------------------------------------------------------------
# convert-gguf: the same files as mlx-lm model directories


#: (architecture, linear format, reference model type, its config beyond the sizes, files'
#: options) for each architecture the conversion maps.
_CONVERSIONS = [
    ("llama", "Q4_K", "llama", {}, {}),
    ("llama", "Q6_K", "llama", {}, {"tied": True}),
    ("qwen2", "Q5_0", "qwen2", {}, {"tied": True}),
    ("qwen3", "Q8_0", "qwen3", {}, {}),
    ("phi3", "Q5_K", "phi3", {"partial_rotary_factor": 0.5}, {"rope_dim": 32}),
    ("gemma2", "Q3_K", "gemma2", {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 8.0,
                                  "query_pre_attn_scalar": SIZES["head_dim"]}, {"tied": True}),
    ("gemma3", "Q5_1", "gemma3_text", {"n_layer": 6, "sliding_window": 4,
                                       "sliding_window_pattern": 6,
                                       "query_pre_attn_scalar": SIZES["head_dim"],
                                       "rope_local_base_freq": 10000.0},
     {"tied": True, "sizes": {"n_layer": 6}}),
    ("qwen3moe", "Q4_K", "qwen3_moe", _MOE_CONFIG["qwen3_moe"], {"experts": True}),
    ("llama", "Q4_1", "mixtral", _MOE_CONFIG["mixtral"], {"experts": True}),
]


@pytest.mark.parametrize("arch, linear, model_type, config, options", _CONVERSIONS)
def test_convert_gguf_maps_every_architecture_exactly(tmp_path, arch, linear, model_type,
                                                      config, options):
    """``dtype="f32"``: every weight is its exact value, so mlx-lm's model of the directory
    gives the logits of the reference model over the exact weights, bit for bit. ``"keep"``:
    the formats MLX computes exactly stay quantized (their dequantized values exact too), Q2_K,
    Q3_K and Q6_K become their exact float32 values; mlx-lm loads the directory strictly."""
    import mlx_lm

    from pyloader.io.gguf_affine import AFFINE_TYPES

    path = tmp_path / "m.gguf"
    exact = write_model(path, arch, linear, embed="Q8_0", seed=7, **options)
    want = logits(reference_model(model_type, exact, **config))
    model, tok = mlx_lm.load(str(convert_gguf(path, tmp_path / "f32", dtype="f32")))
    assert np.array_equal(logits(model), want)
    assert tok.eos_token_id == 2

    f32 = mx.load(str(tmp_path / "f32" / "model.safetensors"))
    keep = mx.load(str(convert_gguf(path, tmp_path / "keep") / "model.safetensors"))
    assert {n for n in keep if not n.endswith((".scales", ".biases"))} == set(f32)
    formats = set()
    for name, w in keep.items():
        base = name.removesuffix(".weight")
        if f"{base}.scales" in keep:  # MLX's affine format: its values exactly the file's
            bits = w.shape[-1] * 32 // keep[f"{base}.scales"].shape[-1] // 32
            w = mx.dequantize(w, keep[f"{base}.scales"].astype(mx.float32),
                              keep[f"{base}.biases"].astype(mx.float32), group_size=32,
                              bits=bits)
            formats.add(bits)
        elif name.endswith((".scales", ".biases")):
            continue
        assert w.dtype == mx.float32 and np.array_equal(np.array(w), np.array(f32[name])), name
    assert formats == ({AFFINE_TYPES[linear], 8} if linear in AFFINE_TYPES else {8})
    # It runs, in half precision where the scales are float16 (the formats before K-quants;
    # MLX computes in the scales' dtype): close, not equal.
    model, _ = mlx_lm.load(str(tmp_path / "keep"))
    scale = np.abs(want).max()
    np.testing.assert_allclose(logits(model), want, rtol=0, atol=1e-2 * scale)


def test_convert_gguf_refuses_what_it_cannot_reproduce(tmp_path):
    """RoPE factors have no mlx-lm config that reproduces them; a file missing a block's
    tensor is refused, as in place; nothing is written."""
    path = tmp_path / "m.gguf"
    write_model(path, "llama", "Q8_0", rope_factors=np.linspace(1, 8, 32, dtype=np.float32))
    with pytest.raises(UnsupportedError, match="rope_freqs.weight"):
        convert_gguf(path, tmp_path / "out")
    write_model(path, "qwen3", "Q8_0", types={"blk.1.attn_q_norm.weight": None})
    for call in (lambda: convert_gguf(path, tmp_path / "out"),
                 lambda: pyloader.load_model(path, kernels="auto")):
        with pytest.raises(FormatError, match=r"no tensor 'blk\.1\.attn_q_norm\.weight'"):
            call()
    assert not (tmp_path / "out").exists()
