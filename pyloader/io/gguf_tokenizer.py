"""The tokenizer of a GGUF file rebuilt as Hugging Face files."""

from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import FormatError, UnsupportedError
from .gguf_checks import Metadata, TokenizerMetadata

log = logging.getLogger(__name__)

# tokenizer.ggml.pre values meaning "every digit alone, then the GPT-2 split" ("gpt2"/"default":
# the plain GPT-2 split); any other value is refused.
_PRE_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_PRE_GPT2 = ("gpt2", "gpt-2", "default")
# tokenizer.ggml.pre values splitting by one regular expression before the byte mapping: the
# expressions the models' own tokenizers (and llama.cpp's) use.
_PRE_SPLIT = {
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
              r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+"),
}

_LLAMA3 = _PRE_SPLIT["llama-bpe"]
_PRE_SPLIT.update({"llama3": _LLAMA3, "llama-v3": _LLAMA3})
# tokenizer.ggml.pre values whose pieces are taken whole when the vocabulary has them, before
# any merge (llama.cpp's llama 3 pre-tokenizer, as the models' own tokenizers do).
_PRE_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4


def build_tokenizer(meta: Metadata, tm: TokenizerMetadata):
    """A Hugging Face ``tokenizers`` tokenizer (its JSON text) from the checked metadata:
    byte-level BPE (``tokenizer.ggml.model`` ``"gpt2"``) or SentencePiece BPE (``"llama"``),
    tokenizing as llama.cpp does."""
    try:
        import tokenizers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "a GGUF file's tokenizer is rebuilt with the Hugging Face 'tokenizers' package "
            "(pip install tokenizers; mlx-lm already depends on it)") from exc
    kind = meta.string("tokenizer.ggml.model", None)
    if kind == "llama":
        return _sentencepiece(meta, tm)
    if kind != "gpt2":
        raise UnsupportedError(
            f"{meta.path}: tokenizer.ggml.model is {kind!r}; supported: 'gpt2' (byte-level "
            "BPE) and 'llama' (SentencePiece)")
    return _byte_level(meta, tm)


def _pre_tokenizer(meta: Metadata):
    from tokenizers import Regex, pre_tokenizers

    pre = meta.string("tokenizer.ggml.pre", "default")
    if pre in _PRE_DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_SPLIT:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLIT[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise UnsupportedError(
        f"{meta.path}: tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers are "
        f"{', '.join(_PRE_GPT2 + _PRE_DIGITS_THEN_GPT2 + tuple(_PRE_SPLIT))}")


def _byte_level(meta: Metadata, tm: TokenizerMetadata) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    path = meta.path
    pre_tok = _pre_tokenizer(meta)
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
        tok = Tokenizer(models.BPE(
            vocab=vocab, merges=tm.merges, unk_token=unk, fuse_unk=False, byte_fallback=False,
            ignore_merges=meta.string("tokenizer.ggml.pre", "default") in _PRE_IGNORE_MERGES))
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.Sequence(
            [processors.ByteLevel(trim_offsets=False), *_specials_added(tm)])
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


def _specials_added(tm: TokenizerMetadata) -> list:
    """The BOS/EOS the metadata says encoding adds (``tokenizer.ggml.add_bos_token``), as a
    post-processor (empty when none)."""
    from tokenizers import processors

    ends = [(tm.special_ids[k], flag) for k, flag in (("bos", tm.add_bos), ("eos", tm.add_eos))
            if flag and k in tm.special_ids]
    if not ends:
        return []
    bos = [tm.tokens[tm.special_ids["bos"]]] if tm.add_bos and "bos" in tm.special_ids else []
    eos = [tm.tokens[tm.special_ids["eos"]]] if tm.add_eos and "eos" in tm.special_ids else []
    single = " ".join([*bos, "$A", *eos])
    pair = " ".join([*bos, "$A", *eos, *bos, "$B:1", *eos])
    return [processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(tm.tokens[i], i) for i, _ in ends])]


def _sentencepiece(meta: Metadata, tm: TokenizerMetadata) -> str:
    """SentencePiece BPE as llama.cpp runs it: spaces as U+2581 (one prefixed), the pair
    whose merged piece scores highest merged first, bytes outside the vocabulary as
    ``<0xXX>`` pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    path = meta.path
    tokens, types = tm.tokens, tm.types
    if tm.scores is None:
        raise FormatError(f"{path}: a SentencePiece ('llama') vocabulary needs "
                          "tokenizer.ggml.scores")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    scores = tm.scores
    merges = []
    for piece, i in vocab.items():
        if types[i] not in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], i, vocab[left], vocab[right], left, right))
    merges.sort()
    unk_id = tm.special_ids.get("unk")
    unk = tokens[unk_id] if unk_id is not None else None
    step = "tokenizer.ggml.tokens and tokenizer.ggml.scores"
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges],
                                   unk_token=unk, fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Replace(" ", "\u2581")]
        if tm.add_space_prefix:
            steps.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = None
        decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if tm.add_space_prefix:
            decode.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(decode)
        tok.post_processor = processors.Sequence(_specials_added(tm))
        step = "tokenizer.ggml.tokens and tokenizer.ggml.token_type"
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
        step = "tokenizer.ggml.tokens"
        text = tok.to_str(pretty=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the library's own types, and a Rust panic (BaseException)
        raise FormatError(f"{path}: metadata {step}: the tokenizers library refuses them "
                          f"({type(exc).__name__}: {exc})") from exc
    return text
