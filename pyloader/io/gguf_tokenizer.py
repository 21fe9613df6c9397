"""The tokenizer of a GGUF file rebuilt as Hugging Face files."""

from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import FormatError, UnsupportedError
from .gguf_checks import Metadata, TokenizerMetadata

__all__ = ["build_tokenizer", "tokenizer_files"]

log = logging.getLogger(__name__)

# tokenizer.ggml.pre values meaning "every digit alone, then the GPT-2 split" ("gpt2"/"default":
# the plain GPT-2 split); any other value is refused.
_PRE_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_PRE_GPT2 = ("gpt2", "default")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4


def build_tokenizer(meta: Metadata, tm: TokenizerMetadata):
    """A Hugging Face ``tokenizers`` byte-level BPE tokenizer from the checked metadata."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "convert_gguf needs the Hugging Face 'tokenizers' package to write tokenizer.json "
            "(pip install tokenizers; mlx-lm already depends on it)") from exc

    path = meta.path
    kind = meta.string("tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise UnsupportedError(
            f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') "
            "tokenizers are supported")
    pre = meta.string("tokenizer.ggml.pre", "default")
    if pre in _PRE_DIGITS_THEN_GPT2:
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _PRE_GPT2:
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise UnsupportedError(
            f"{path}: tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers are "
            f"{', '.join(_PRE_GPT2 + _PRE_DIGITS_THEN_GPT2)}")

    tokens, types = tm.tokens, tm.types
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicate keeps its first id, as llama.cpp does
    if len(vocab) != len(tokens):
        log.warning("%s: %d duplicate tokens in the vocabulary", path, len(tokens) - len(vocab))
    unk_id = tm.special_ids.get("unk")
    unk = tokens[unk_id] if unk_id is not None and types[unk_id] == _TOKEN_UNKNOWN else None
    step = "tokenizer.ggml.tokens and tokenizer.ggml.merges"
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=tm.merges, unk_token=unk,
                                   fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        step = "tokenizer.ggml.tokens and tokenizer.ggml.token_type"
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
        if user:
            tok.add_tokens(user)
        step = "tokenizer.ggml.tokens"
        text = tok.to_str(pretty=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the library's own types, and a Rust panic (BaseException)
        raise FormatError(f"{path}: metadata {step}: the tokenizers library refuses them "
                          f"({type(exc).__name__}: {exc})") from exc
    return text


def tokenizer_files(meta: Metadata, tm: TokenizerMetadata, tokenizer_json: str,
                     context_length: int) -> tuple[dict[str, str], dict[str, int]]:
    """The tokenizer files' texts and the special token ids for ``config.json``."""
    special: dict[str, str] = {}
    ids: dict[str, int] = {}
    for key, i in tm.special_ids.items():
        special[f"{key}_token"] = tm.tokens[i]
        ids[f"{key}_token_id"] = i
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tm.add_bos,
        "add_eos_token": tm.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        **special,
    }
    if tm.chat_template:
        config["chat_template"] = tm.chat_template
    files = {"tokenizer.json": tokenizer_json,
             "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
             "special_tokens_map.json": json.dumps(special, indent=2, ensure_ascii=False)}
    return files, ids
