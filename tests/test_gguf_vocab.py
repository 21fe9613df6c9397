"""GGUF tokenizers rebuilt from real vocabularies tokenize as llama.cpp does.

llama.cpp's own tokenizer test data (``models/ggml-vocab-*.gguf``: the vocabularies of real
models, with ``.inp`` texts and the ``.out`` token ids llama.cpp must give them) ships inside
llama-cpp-python's source distribution on PyPI. It is fetched once into the cache (checked
against PyPI's SHA-256), and each vocabulary's tokenizer, rebuilt as ``load_model`` rebuilds
a GGUF file's, must give those ids for every text: SentencePiece (llama, phi-3) and
byte-level BPE with each pre-tokenizer pyloader reads (llama 3, qwen2, gpt-2, starcoder,
refact)."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from pyloader.compare.system import cache_dir
from pyloader.io.gguf_checks import Metadata, tokenizer_metadata
from pyloader.io.gguf_header import read_header
from pyloader.io.gguf_tokenizer import build_tokenizer

RELEASE = "0.3.36"
VOCABS = ("llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "starcoder", "refact")
#: How llama.cpp's .inp files separate (and end) their texts.
SEPARATOR = "\n__ggml_vocab_test__\n"


def _sdist() -> tuple[str, str]:
    """The URL and SHA-256 of llama-cpp-python's source distribution, from PyPI."""
    index = "https://pypi.org/pypi/llama-cpp-python/json"
    with urllib.request.urlopen(index, timeout=60) as r:
        files = json.load(r)["releases"][RELEASE]
    sdist = next(f for f in files if f["packagetype"] == "sdist")
    return urllib.parse.urljoin(index, sdist["url"]), sdist["digests"]["sha256"]


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    """The vocabularies, texts and token ids of :data:`VOCABS`, fetched once."""
    root = cache_dir("llama-cpp-vocab", RELEASE)
    names = [f"ggml-vocab-{v}.gguf{ext}" for v in VOCABS for ext in ("", ".inp", ".out")]
    if all((root / n).is_file() for n in names):
        return root
    url, sha256 = _sdist()
    tmp = root / f".sdist-{os.getpid()}.tar.gz"
    try:
        urllib.request.urlretrieve(url, tmp)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        assert digest == sha256, f"{url}: SHA-256 {digest}, PyPI lists {sha256}"
        with tarfile.open(tmp) as tar:
            for member in tar.getmembers():
                name = member.name.rsplit("/", 1)[-1]
                if name in names and "/vendor/llama.cpp/models/" in member.name:
                    (root / f".{name}.tmp").write_bytes(tar.extractfile(member).read())
                    os.replace(root / f".{name}.tmp", root / name)
    finally:
        tmp.unlink(missing_ok=True)
    missing = [n for n in names if not (root / n).is_file()]
    assert not missing, f"llama-cpp-python {RELEASE}'s sdist lacks {missing}"
    return root


@pytest.mark.parametrize("vocab", VOCABS)
def test_a_real_vocabulary_tokenizes_as_llama_cpp(vocab_dir, vocab):
    from tokenizers import Tokenizer

    path = vocab_dir / f"ggml-vocab-{vocab}.gguf"
    header = read_header(path, values=True)
    meta = Metadata(header, header.values)
    tokens = meta.strings("tokenizer.ggml.tokens")
    tokenizer = Tokenizer.from_str(build_tokenizer(meta, tokenizer_metadata(meta, len(tokens))))
    texts = (vocab_dir / f"{path.name}.inp").read_text(encoding="utf-8")
    texts = texts.removesuffix(SEPARATOR).split(SEPARATOR)
    ids = (vocab_dir / f"{path.name}.out").read_text().splitlines()
    assert len(texts) == len(ids) > 40
    for text, want in zip(texts, ids):
        got = tokenizer.encode(text, add_special_tokens=False).ids
        assert got == [int(i) for i in want.split()], (vocab, text)
