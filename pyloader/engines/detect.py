"""Which engine a model directory is for, from its ``config.json`` and checkpoint
tensor names, without importing any engine. Rules, in order: Whisper dimensions ->
mlx-whisper; a vision/audio tower with weights -> mlx-vlm (mlx-embeddings for an encoder it
serves); an encoder architecture -> mlx-embeddings; else by ``model_type`` registry, mlx-lm
first. See docs/engines.md."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

from ..errors import FormatError
from ..io.checkpoint import Checkpoint

#: Import name → pip name of every engine ``load_model(engine=...)`` knows.
ENGINES = {
    "mlx_lm": "mlx-lm",
    "mlx_vlm": "mlx-vlm",
    "mlx_whisper": "mlx-whisper",
    "mlx_embeddings": "mlx-embeddings",
}
#: The versions pyloader's tests build and compare models with.
TESTED = {"mlx_lm": "0.32.2", "mlx_vlm": "0.7.10", "mlx_whisper": "0.4.3",
          "mlx_embeddings": "0.1.0"}

WHISPER_DIMS = ("n_mels", "n_audio_ctx", "n_audio_state", "n_audio_head", "n_audio_layer",
                "n_vocab", "n_text_ctx", "n_text_state", "n_text_head", "n_text_layer")
TOWER_CONFIGS = ("vision_config", "audio_config", "speech_config", "vision_tower_config")
#: Module names (path components, or their prefixes) of non-text towers and projectors.
TOWER_MODULES = re.compile(
    r"(^|\.)(vision|visual|audio|image|img_|speech|sam_model|aligner|mm_projector|"
    r"multi_modal_projector|vl_connector|patch_merge|embed_vision|embed_audio)")
ENCODER_ARCH = re.compile(
    r"(Model|ForMaskedLM|ForSequenceClassification|ForTokenClassification|"
    r"ForQuestionAnswering|ForTextEmbedding|ForEmbedding)$")
GENERATIVE_ARCH = re.compile(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration)$")


def read_config(path: str | os.PathLike[str]) -> dict | None:
    """``config.json`` of a model directory as a dict; None when missing or not a
    JSON object."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        with open(cfg, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def spec_of(engine: str):
    """The engine package's import spec, or None (found without importing it)."""
    try:
        return importlib.util.find_spec(engine)
    except (ImportError, ValueError):  # a finder that refuses it, a module set to None
        return None


def installed(engine: str) -> bool:
    """The engine's package can be imported (checked without importing it)."""
    return spec_of(engine) is not None


def in_registry(engine: str, model_type: str) -> bool | None:
    """The engine has an architecture module for ``model_type`` (None: engine not
    installed). Read from its ``models/`` directory, without importing."""
    spec = spec_of(engine)
    if spec is None or not spec.submodule_search_locations:
        return None
    names = {model_type, model_type.replace("-", "_")}
    if engine == "mlx_lm":
        from mlx_lm.utils import MODEL_REMAPPING  # installed: its spec was found

        names |= {MODEL_REMAPPING.get(n, n) for n in names}
    return any((models / n).is_dir() or (models / f"{n}.py").is_file()
               for models in (Path(root) / "models" for root in spec.submodule_search_locations)
               for n in names)


def has_tower(config: dict, path: str | os.PathLike[str]) -> bool:
    """The config describes a vision/audio tower and the checkpoint holds its weights
    (without a readable checkpoint, the config alone decides)."""
    if not any(config.get(k) for k in TOWER_CONFIGS):
        return False
    try:
        names = Checkpoint(path).keys()
    except (FormatError, OSError, ValueError):
        return True
    return any(TOWER_MODULES.search(n) for n in names)


def is_encoder(config: dict) -> bool:
    """Every architecture named is an encoder's (no generative head)."""
    archs = config.get("architectures") or []
    return bool(archs) and all(isinstance(a, str) and ENCODER_ARCH.search(a)
                               and not GENERATIVE_ARCH.search(a) for a in archs)


def detect(path: str | os.PathLike[str]) -> str:
    """The engine import name (``"mlx_lm"``, ``"mlx_vlm"``, ``"mlx_whisper"``,
    ``"mlx_embeddings"``) that builds the model in ``path``, by the module's rules. No readable
    ``config.json``: ``"mlx_lm"``."""
    config = read_config(path)
    if config is None:
        return "mlx_lm"
    if all(k in config for k in WHISPER_DIMS):
        return "mlx_whisper"
    model_type = str(config.get("model_type") or "")
    lm, emb, vlm = (in_registry(e, model_type) if model_type else None
                    for e in ("mlx_lm", "mlx_embeddings", "mlx_vlm"))
    if has_tower(config, path):
        return "mlx_embeddings" if is_encoder(config) and emb else "mlx_vlm"
    if is_encoder(config) and (emb or (emb is None and not lm)):
        return "mlx_embeddings"
    if lm or not model_type:
        return "mlx_lm"
    if emb:
        return "mlx_embeddings"
    if vlm and lm is False:
        return "mlx_vlm"
    return "mlx_lm"  # mlx-lm's loader names what it lacks (or runs a model_file)
