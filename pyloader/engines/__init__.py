"""Models of other MLX engines (mlx-vlm, mlx-whisper, mlx-embeddings) built by the
engine, with their weights read and streamed by pyloader. Outputs are bit-identical to the
engine's own load. Engines are imported only when needed. See docs/engines.md."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import mlx.core as mx

from ..errors import EngineError, EngineNotInstalledError
from ..io.checkpoint import Checkpoint
from ..io.hub import resolve
from ..streaming import StreamOptions, block_patterns, stream
from .builders import SPECS, Built
from .capture import LoadCapture, sources
from .detect import ENGINES, TESTED, detect, installed

log = logging.getLogger(__name__)

#: The engines :func:`load` builds (import names); ``"mlx_lm"`` is ``load_model``'s own.
OTHER_ENGINES = tuple(SPECS)


def check_engine(engine: str) -> str:
    """``engine`` if ``"auto"`` or a known engine's import name (pip names accepted);
    ValueError otherwise."""
    name = engine.replace("-", "_") if isinstance(engine, str) else engine
    if name != "auto" and name not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected 'auto' or one of "
                         f"{tuple(ENGINES)}")
    return name


def require(engine: str, path: str | os.PathLike[str]) -> None:
    """EngineNotInstalledError naming the package to install when ``engine`` is missing."""
    if not installed(engine):
        pkg = ENGINES[engine]
        raise EngineNotInstalledError(
            f"{path} is a {pkg} model and {pkg} is not installed: pip install "
            f"{pkg}=={TESTED[engine]} (pyloader never loads it as a smaller model)",
            engine=engine, package=pkg, model_path=os.fspath(path))


def load(path_or_repo: str | os.PathLike[str], engine: str = "auto",
         options: StreamOptions | None = None, *, strict: bool = True, lazy: bool = False,
         processor: bool = True, revision: str | None = None, **engine_args: Any):
    """Build an mlx-vlm, mlx-whisper or mlx-embeddings model with its engine, its weights
    from pyloader: resident per ``options.resident``, the rest streamed.

    Args:
        path_or_repo: The model directory, or a Hugging Face repo id in the local hub cache.
        engine: ``"auto"`` (:func:`detect`), ``"mlx_vlm"``, ``"mlx_whisper"`` or
            ``"mlx_embeddings"``.
        options: The streaming settings. ``options.units`` None: every block list of the
            model, in model order (:func:`pyloader.streaming.units.block_patterns`).
        strict: Passed to the engine's loader where it takes one (mlx-vlm).
        lazy: False: every resident parameter is in memory on return.
        processor: Also load the processor/tokenizer when the directory has its files.
        revision: With a repo id: a branch, tag or commit.
        **engine_args: The engine loader's own keywords.

    Returns:
        What the engine's loader returns: mlx-vlm ``(model, processor)``, mlx-whisper
        ``model``, mlx-embeddings ``(model, tokenizer)`` (None for a missing processor).

    Raises:
        EngineNotInstalledError: the engine is not installed (names the package).
        EngineError: the engine cannot build the directory (its error is the cause), or
            ``engine="auto"`` finds an mlx-lm model.
    """
    t0 = time.perf_counter()
    path = resolve(path_or_repo, revision)
    name = check_engine(engine)
    if name == "auto":
        name = detect(path)
    if name == "mlx_lm":
        raise EngineError(f"{path} is an mlx-lm model: load it with pyloader.load_model",
                          engine=name, package=ENGINES[name], model_path=os.fspath(path))
    require(name, path)
    opts = StreamOptions() if options is None else options
    try:
        ckpt = Checkpoint(path)
    except FileNotFoundError as exc:
        raise EngineError(
            f"{path}: no safetensors checkpoint ({exc}); pyloader reads safetensors (an "
            "mlx-whisper weights.npz: mx.save_safetensors(path, dict(mx.load(npz))))",
            engine=name, package=ENGINES[name], model_path=os.fspath(path)) from exc
    built, found = _build(SPECS[name], path, ckpt, strict=strict, processor=processor,
                          engine_args=engine_args)
    if found.computed:
        mx.eval(list(found.computed.values()))
        log.info("%s: %d parameters computed by %s's loader are kept resident: %s",
                 path, len(found.computed), ENGINES[name], sorted(found.computed)[:5])
    if opts.units is None:
        opts = opts.with_(units=block_patterns(built.model) or None)
    controller = stream(built.model, ckpt, opts, tensors=found.direct,
                        derived=found.computed, strict=True, lazy=lazy)
    controller.load_s = time.perf_counter() - t0  # the engine's build included
    return built.result


def _build(spec, path, ckpt: Checkpoint, *, strict: bool, processor: bool,
           engine_args: dict):
    """The engine's build under a load capture; rerun with real loads when a shapes-only
    array was computed with."""
    for shapes_only in ((True, False) if spec.evaluates else (False,)):
        try:
            with LoadCapture(ckpt, shapes_only=shapes_only) as cap:
                built: Built = spec.build(path, lazy_loads=True, strict=strict,
                                          processor=processor, **engine_args)
        except (EngineError, MemoryError):
            raise
        except Exception as exc:
            raise EngineError(
                f"{ENGINES[spec.name]} cannot build {path}: {type(exc).__name__}: {exc}",
                engine=spec.name, package=ENGINES[spec.name],
                model_path=os.fspath(path)) from exc
        found = sources(built.model, cap)
        if not found.unknown:
            return built, found
        log.info("%s: %s computes %d parameters (%s, ...): built again from real loads",
                 path, ENGINES[spec.name], len(found.unknown), found.unknown[0])
    raise AssertionError("unreachable: real loads leave no parameter unknown")


__all__ = ["ENGINES", "OTHER_ENGINES", "TESTED", "LoadCapture", "check_engine", "detect",
           "load"]
