"""Each engine's own loading steps (loader, then what its top-level ``load`` adds),
as pyloader runs them under a load capture. Engines are imported only when called."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn

#: Files whose presence means the directory ships a tokenizer or processor.
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "vocab.txt", "preprocessor_config.json", "processor_config.json")


def has_processor(path: Path) -> bool:
    """The directory has tokenizer or processor files."""
    return any((path / f).exists() for f in PROCESSOR_FILES)


@dataclass(frozen=True)
class Built:
    """What a builder made: ``result`` as the engine's ``load`` returns it, and the model."""

    result: Any
    model: nn.Module


def vlm(path: Path, *, lazy_loads: bool, strict: bool, processor: bool,
        **kwargs: Any) -> Built:
    """mlx-vlm: ``load_model`` then the processor, as ``mlx_vlm.load``: ``(model, processor)``;
    processor None without processor files or with ``processor=False``."""
    utils = importlib.import_module("mlx_vlm.utils")
    model = utils.load_model(path, lazy=lazy_loads, strict=strict, **kwargs)
    proc = None
    if processor and has_processor(path):
        image_processor = utils.load_image_processor(path, **kwargs)
        eos = getattr(model.config, "eos_token_id", None)
        proc = utils.load_processor(path, True, eos_token_ids=eos, **kwargs)
        if image_processor is not None:
            proc.image_processor = image_processor
    return Built((model, proc), model)


def whisper(path: Path, *, lazy_loads: bool, strict: bool, processor: bool,
            **kwargs: Any) -> Built:
    """mlx-whisper: ``load_models.load_model(path, dtype=...)``, the model alone."""
    del lazy_loads, strict, processor  # its loader evaluates, and updates non-strictly
    model = importlib.import_module("mlx_whisper.load_models").load_model(str(path), **kwargs)
    return Built(model, model)


def embeddings(path: Path, *, lazy_loads: bool, strict: bool, processor: bool,
               **kwargs: Any) -> Built:
    """mlx-embeddings: ``load_model`` then the processor or tokenizer, as
    ``mlx_embeddings.load``: ``(model, tokenizer)``; tokenizer None without its files or with
    ``processor=False``."""
    del strict  # its loader always loads strictly
    utils = importlib.import_module("mlx_embeddings.utils")
    tokenizer_config = kwargs.pop("tokenizer_config", None) or {}
    model_config = kwargs.pop("model_config", None) or {}
    config = utils.load_config(path)
    config.update(model_config)
    model = utils.load_model(path, lazy_loads, model_config,
                             path_to_repo=kwargs.pop("path_to_repo", str(path)), **kwargs)
    tok = None
    if processor and has_processor(path):
        arch = utils._get_model_arch(config)  # the lookup mlx_embeddings.load makes
        if hasattr(arch, "Processor"):
            tok = arch.Processor.from_pretrained(path, **tokenizer_config)
        elif hasattr(model.config, "vision_config"):
            from transformers import AutoProcessor

            tok = AutoProcessor.from_pretrained(path)
        else:
            tok = utils.load_tokenizer(path, tokenizer_config)
    return Built((model, tok), model)


@dataclass(frozen=True)
class EngineSpec:
    """How pyloader builds one engine's models.

    Attributes:
        name: Import name (``"mlx_vlm"``).
        build: The builder.
        evaluates: The loader evaluates every parameter (the capture hands out shapes-only arrays).
    """

    name: str
    build: Callable[..., Built]
    evaluates: bool = False


SPECS = {
    "mlx_vlm": EngineSpec("mlx_vlm", vlm),
    "mlx_whisper": EngineSpec("mlx_whisper", whisper, evaluates=True),
    "mlx_embeddings": EngineSpec("mlx_embeddings", embeddings),
}
