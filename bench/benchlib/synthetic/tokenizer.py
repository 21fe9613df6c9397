"""A small byte-level tokenizer for synthetic models: a prompt of N bytes is N tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

#: The special tokens, after the 256 byte tokens.
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CONSONANTS = "bcdfghjklmnprstvwxyz"
_VOWELS = "aeiou"


def _filler(i: int) -> str:
    """Token ``i``'s spelling: base-100 digits as consonant-vowel syllables after a space."""
    syllables = []
    while True:
        i, d = divmod(i, 100)
        syllables.append(_CONSONANTS[d // 5] + _VOWELS[d % 5])
        if i == 0:
            break
    return "\u0120" + "".join(reversed(syllables))


def write_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> Path:
    """Writes the tokenizer files into ``path`` (unless present); returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return path
    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 byte tokens and "
                         f"{len(SPECIALS)} special tokens")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    first = len(vocab)
    for i in range(first, vocab_size):
        vocab[_filler(i - first)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    return path


