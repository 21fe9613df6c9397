"""A small tokenizer for synthetic models, so that they load and generate like real ones
(``pyloader.load_model`` returns a tokenizer; ``mlx_lm.generate`` and ``pyloader generate``
run on them).

:func:`write_tokenizer` writes ``tokenizer.json`` (a byte-level BPE built with the
``tokenizers`` package mlx-lm depends on, through transformers) and
``tokenizer_config.json`` (a ChatML chat template, ``<|im_end|>`` as end of sequence) for
a vocabulary of exactly the model's size: the 256 byte tokens, the three specials, and
filler tokens spelled as syllables (``" baxo"``) so that a random model's output decodes
to readable, deterministic text. Text encodes to its bytes (no merges): a prompt of N
bytes is N tokens.
"""

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
    """Token ``i``'s spelling: its digits in base 100 as consonant-vowel syllables after
    a space (byte-level ``Ġ``)."""
    syllables = []
    while True:
        i, d = divmod(i, 100)
        syllables.append(_CONSONANTS[d // 5] + _VOWELS[d % 5])
        if i == 0:
            break
    return "\u0120" + "".join(reversed(syllables))


def write_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> Path:
    """Writes the tokenizer files into the model directory ``path`` (unless a
    ``tokenizer.json`` is there already) for ``vocab_size`` token ids. Returns ``path``."""
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


__all__ = ["CHAT_TEMPLATE", "SPECIALS", "write_tokenizer"]
