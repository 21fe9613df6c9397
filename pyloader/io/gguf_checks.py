"""A GGUF file's metadata checked as it is read (:class:`Metadata`): the model's sizes and
RoPE, the tokenizer's values, each tensor's expected shape."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import FormatError, UnsupportedError
from .gguf_header import GGUFHeader

INTEGER_TYPES = frozenset({"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64",
                           "int64"})
_INT64_MAX = 2**63 - 1
_MISSING = object()

# GGUF tensor name (without .weight/.bias) -> mlx-lm module path. "{i}" is the block index.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _value(v: Any) -> Any:
    """A metadata value as MLX returns it, as plain Python."""
    tolist = getattr(v, "tolist", None)
    return tolist() if tolist is not None else v


class Metadata:
    """Typed, checked access to a GGUF file's metadata; each getter raises :class:`FormatError`
    naming the file, the key and the rule broken."""

    def __init__(self, header: GGUFHeader, values: dict[str, Any]):
        self.path = header.path
        self._types = header.value_types
        self._values = values

    def fail(self, key: str, rule: str) -> FormatError:
        return FormatError(f"{self.path}: metadata {key!r}: {rule}")

    def has(self, key: str) -> bool:
        return key in self._values

    def _raw(self, key: str, default: Any, kind: str) -> tuple[Any, str]:
        if key not in self._values:
            if default is _MISSING:
                raise FormatError(f"{self.path}: GGUF metadata has no {key!r} ({kind})")
            return default, ""
        return _value(self._values[key]), self._types.get(key, "")

    def string(self, key: str, default: Any = _MISSING) -> Any:
        v, vtype = self._raw(key, default, "a string")
        if vtype and vtype != "string":
            raise self.fail(key, f"a {vtype} value where a string belongs")
        return v

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> Any:
        """An integer of at least ``minimum`` (a count or a size: 1)."""
        v, vtype = self._raw(key, default, "an integer")
        if not vtype:
            return v
        if vtype not in INTEGER_TYPES:
            raise self.fail(key, f"a {vtype} value where an integer belongs")
        if not minimum <= v <= _INT64_MAX:
            raise self.fail(key, f"{v} is not an integer from {minimum} to {_INT64_MAX}")
        return v

    def real(self, key: str, default: float, *, positive: bool = True) -> float:
        """A finite number (positive when ``positive``), as the shortest decimal that round-trips
        its float32 (1e-05, not 9.999999747378752e-06: what a Hugging Face config says)."""
        v, vtype = self._raw(key, default, "a number")
        if vtype and vtype != "float32" and vtype not in INTEGER_TYPES:
            raise self.fail(key, f"a {vtype} value where a number belongs")
        v = float(np.float32(v)) if vtype == "float32" else float(v)
        if not math.isfinite(v) or (positive and v <= 0):
            raise self.fail(key, f"{v} is not a finite{' positive' if positive else ''} "
                                 "number")
        return float(str(np.float32(v)))

    def flag(self, key: str, default: bool) -> bool:
        v, vtype = self._raw(key, default, "a bool")
        if vtype and vtype != "bool":
            raise self.fail(key, f"a {vtype} value where a bool belongs")
        return bool(v)

    def strings(self, key: str) -> list[str]:
        v, vtype = self._raw(key, _MISSING, "an array of strings")
        if vtype != "array[string]":
            raise self.fail(key, f"a {vtype} value where an array of strings belongs")
        return v

    def reals(self, key: str) -> list[float]:
        """An array of finite numbers."""
        v, vtype = self._raw(key, _MISSING, "an array of numbers")
        if vtype not in ("array[float32]", "array[float64]"):
            raise self.fail(key, f"a {vtype} value where an array of numbers belongs")
        if not all(math.isfinite(x) for x in v):
            raise self.fail(key, "holds a value that is not a finite number")
        return v

    def integers(self, key: str, default: Any = _MISSING) -> Any:
        v, vtype = self._raw(key, default, "an array of integers")
        if not vtype:
            return v
        if not (vtype.startswith("array[") and vtype[6:-1] in INTEGER_TYPES):
            raise self.fail(key, f"a {vtype} value where an array of integers belongs")
        return [v] if isinstance(v, int) else v

    def token_id(self, key: str, n_tokens: int) -> int | None:
        """A token id (None when the key is absent) naming one of the ``n_tokens``."""
        v = self.integer(key, None, minimum=0)
        if v is not None and v >= n_tokens:
            raise self.fail(key, f"token id {v} is outside the vocabulary of {n_tokens} "
                                 "tokens")
        return v


@dataclass(frozen=True)
class LlamaConfig:
    """The sizes and settings of a llama GGUF file, checked (see :func:`llama_config`)."""

    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    n_expert: int = 0  # a mixture of experts: how many, how many each token uses, their width
    n_expert_used: int = 0
    expert_ffn: int = 0

    def hf_config(self, vocab_size: int, *, tied: bool) -> dict[str, Any]:
        """The ``config.json`` fields these sizes give (as Hugging Face's llama names them)."""
        return {
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_head_kv,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "max_position_embeddings": self.context_length,
            "vocab_size": vocab_size,
            "tie_word_embeddings": tied,
        }


def llama_config(meta: Metadata, arch: str, *, partial_rope: bool = False,
                 experts: bool = False) -> LlamaConfig:
    """The model's checked sizes from ``{arch}.*`` (positive, heads dividing evenly, even head
    size; finite positive epsilon, RoPE base and scaling). ``partial_rope``: the model may
    rotate fewer (an even number, at least 2) than all of a head's dimensions; ``experts``:
    it may be a mixture of experts (each token using 1 to all of them)."""
    a = arch
    n_layer = meta.integer(f"{a}.block_count")
    hidden = meta.integer(f"{a}.embedding_length")
    n_expert = meta.integer(f"{a}.expert_count", 0, minimum=0)
    if n_expert and not experts:
        raise UnsupportedError(f"{meta.path}: a mixture-of-experts {a} GGUF ({a}.expert_count="
                               f"{n_expert}) is not converted; load_model reads it in place")
    n_used = meta.integer(f"{a}.expert_used_count") if n_expert else 0
    if n_used > n_expert:
        raise meta.fail(f"{a}.expert_used_count",
                        f"{n_used} experts per token of {n_expert} ({a}.expert_count)")
    expert_ffn = meta.integer(f"{a}.expert_feed_forward_length",
                              meta.integer(f"{a}.feed_forward_length", 0)) if n_expert else 0
    if n_expert and not expert_ffn:
        raise FormatError(f"{meta.path}: GGUF metadata has no '{a}.expert_feed_forward_length' "
                          "(an integer), the experts' width")
    ffn = meta.integer(f"{a}.feed_forward_length", expert_ffn or _MISSING)
    n_head = meta.integer(f"{a}.attention.head_count")
    n_head_kv = meta.integer(f"{a}.attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise meta.fail(f"{a}.attention.head_count_kv",
                        f"{n_head} query heads are not a multiple of {n_head_kv}")
    if not meta.has(f"{a}.attention.key_length") and hidden % n_head:
        raise meta.fail(f"{a}.attention.head_count",
                        f"{n_head} heads do not divide the width {hidden} "
                        f"({a}.embedding_length), and the file has no key_length")
    head_dim = meta.integer(f"{a}.attention.key_length", hidden // n_head)
    if head_dim % 2:
        raise meta.fail(f"{a}.attention.key_length",
                        f"head size {head_dim} is odd; RoPE rotates pairs")
    if meta.integer(f"{a}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedError(f"{meta.path}: key and value head sizes differ")
    rope_dim = meta.integer(f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        if not partial_rope:
            raise UnsupportedError(
                f"{meta.path}: RoPE over {rope_dim} of {head_dim} head dimensions (partial "
                "rotary) is not supported by mlx-lm's llama")
        if not (2 <= rope_dim < head_dim and rope_dim % 2 == 0):
            raise meta.fail(f"{a}.rope.dimension_count",
                            f"RoPE over {rope_dim} of {head_dim} head dimensions: not an even "
                            "number from 2 to the head size")
    scaling_type = meta.string(f"{a}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"type": "linear",
                        "factor": meta.real(f"{a}.rope.scaling.factor", 1.0)}
    elif scaling_type != "none":
        raise UnsupportedError(f"{meta.path}: RoPE scaling {scaling_type!r} is not supported")
    return LlamaConfig(
        n_layer=n_layer, hidden=hidden, ffn=ffn, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, rope_dim=rope_dim,
        context_length=meta.integer(f"{a}.context_length", 2048),
        rms_norm_eps=meta.real(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.real(f"{a}.rope.freq_base", 10000.0), rope_scaling=rope_scaling,
        n_expert=n_expert, n_expert_used=n_used, expert_ffn=expert_ffn)


def block_index(path: str, tensor: str, index: str, n_layer: int) -> int:
    """The block number ``index`` of a ``blk.N.`` tensor name, below ``n_layer``."""
    # Canonical spelling only: "01" or a non-ASCII digit would alias another block.
    if not (index.isascii() and index.isdigit() and str(int(index)) == index):
        raise FormatError(f"{path}: tensor {tensor!r}: {index!r} is not a block number")
    if int(index) >= n_layer:
        raise FormatError(f"{path}: tensor {tensor!r} is beyond block_count={n_layer}")
    return int(index)


def expected_shapes(c: LlamaConfig, vocab: int,
                    arch: str = "llama") -> dict[str, tuple[int, ...]]:
    """Each tensor's row-major shape (name without block prefix), as mlx-lm's ``arch``
    builds it (phi3: Q, K and V in one ``attn_qkv``, gate and up in one ``ffn_up``; a mixture
    of experts: the router ``ffn_gate_inp`` and the experts' stacked matrices)."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    if c.n_expert:
        e, f = c.n_expert, c.expert_ffn
        return {**expected_shapes(replace(c, n_expert=0), vocab, arch),
                "ffn_gate_inp.weight": (e, c.hidden), "ffn_gate_exps.weight": (e, f, c.hidden),
                "ffn_up_exps.weight": (e, f, c.hidden), "ffn_down_exps.weight": (e, c.hidden, f)}
    if arch == "phi3":
        return {**expected_shapes(c, vocab), "attn_qkv.weight": (q + 2 * kv, c.hidden),
                "ffn_up.weight": (2 * c.ffn, c.hidden)}
    return {
        "token_embd.weight": (vocab, c.hidden), "output.weight": (vocab, c.hidden),
        "output_norm.weight": (c.hidden,), "attn_norm.weight": (c.hidden,),
        "ffn_norm.weight": (c.hidden,),
        "attn_q.weight": (q, c.hidden), "attn_k.weight": (kv, c.hidden),
        "attn_v.weight": (kv, c.hidden), "attn_output.weight": (c.hidden, q),
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
        "attn_output.bias": (c.hidden,),
        "ffn_gate.weight": (c.ffn, c.hidden), "ffn_up.weight": (c.ffn, c.hidden),
        "ffn_down.weight": (c.hidden, c.ffn),
        "attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,),
        "post_attention_norm.weight": (c.hidden,), "post_ffw_norm.weight": (c.hidden,),
    }


@dataclass(frozen=True)
class TokenizerMetadata:
    """The tokenizer's metadata, checked (see :func:`tokenizer_metadata`)."""

    tokens: list[str]
    merges: list[tuple[str, str]]
    types: list[int]
    special_ids: dict[str, int]  # "bos", "eos", "unk", "pad" -> token id
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    scores: list[float] | None = None  # SentencePiece ("llama") vocabularies
    add_space_prefix: bool = True


_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}


def tokenizer_metadata(meta: Metadata, vocab: int) -> TokenizerMetadata:
    """``tokenizer.ggml.*`` checked: at most ``vocab`` tokens, merges of known tokens, one type
    per token, special ids in the vocabulary, bool flags, a string chat template."""
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise meta.fail("tokenizer.ggml.tokens", "an empty vocabulary")
    if len(tokens) > vocab:
        raise meta.fail("tokenizer.ggml.tokens",
                        f"{len(tokens)} tokens but an embedding of {vocab} rows")
    known = set(tokens)
    merges = []
    merges_given = meta.has("tokenizer.ggml.merges")
    for m in meta.strings("tokenizer.ggml.merges") if merges_given else ():
        pair = m.split(" ")
        if len(pair) != 2:
            raise meta.fail("tokenizer.ggml.merges",
                            f"merge {m!r} is not two tokens separated by one space")
        for t in (*pair, pair[0] + pair[1]):
            if t not in known:
                raise meta.fail("tokenizer.ggml.merges",
                                f"merge {m!r} names {t!r}, which is not a token")
        merges.append((pair[0], pair[1]))
    if not merges_given and meta.string("tokenizer.ggml.model", None) != "llama":
        raise FormatError(f"{meta.path}: GGUF metadata has no 'tokenizer.ggml.merges' (an "
                          "array of strings), which a BPE vocabulary needs")
    scores = meta.reals("tokenizer.ggml.scores") if meta.has("tokenizer.ggml.scores") else None
    if scores is not None and len(scores) != len(tokens):
        raise meta.fail("tokenizer.ggml.scores", f"{len(scores)} entries for {len(tokens)} "
                                                 "tokens")
    types = meta.integers("tokenizer.ggml.token_type", None)
    if types is None:
        types = [1] * len(tokens)
    if len(types) != len(tokens):
        raise meta.fail("tokenizer.ggml.token_type",
                        f"{len(types)} entries for {len(tokens)} tokens")
    ids = {}
    for name, key in _SPECIAL_KEYS.items():
        i = meta.token_id(f"tokenizer.ggml.{key}_token_id", len(tokens))
        if i is not None:
            ids[name] = i
    return TokenizerMetadata(
        tokens=tokens, merges=merges, types=types, special_ids=ids, scores=scores,
        add_space_prefix=meta.flag("tokenizer.ggml.add_space_prefix", True),
        add_bos=meta.flag("tokenizer.ggml.add_bos_token", False),
        add_eos=meta.flag("tokenizer.ggml.add_eos_token", False),
        chat_template=meta.string("tokenizer.chat_template", None) or None)
