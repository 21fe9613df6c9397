"""``load_model``: the one way pyloader turns a model directory into an mlx-lm model.

Every load takes the same steps, for a plain checkpoint, a head bundle or one rank of a
distributed group::

    lazy skeleton        mlx-lm builds the model from config.json (its arrays never read)
    [shard]              group=: mlx-lm's pipeline or tensor sharding (pyloader.distributed)
    source map           which checkpoint tensor each parameter comes from
                         (pyloader.streaming.sources)
    [restrict]           group=: only this rank's tensors (or its slices of them);
                         bundle: the head's arrays are read and verified apart
                         from the trunk
    attach               the streaming controller loads the resident set and hooks
                         the streamed units (pyloader.streaming)
    [adapter]            adapter_path=: mlx-lm's adapter over resident and streamed layers
    [finish]             group=: the ranks synchronize; bundle: swap_head & co.
    kernels, tokenizer   pyloader's CPU kernels installed; the tokenizer as mlx-lm builds it

Another engine's model (mlx-vlm, mlx-whisper, mlx-embeddings) is built by that engine
(:func:`pyloader.engines.load`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ._util.optional import require_mlx_lm
from .distributed import Distribution, check_lockstep, plan_split, shard_model
from .engines import OTHER_ENGINES, check_engine, detect
from .engines import load as load_engine_model
from .gguf_model import load_for_mlx as gguf_load_for_mlx
from .gguf_model import skeleton as gguf_skeleton
from .heads import BundleLoad, is_bundle
from .io.checkpoint import Checkpoint, refuse_gguf
from .io.gguf_header import is_gguf
from .io.gguf_source import GGUFSource
from .io.config import check_config
from .io.hub import resolve
from .kernels import check_choice, default_choice, effective_choice
from .kernels import install as install_kernels
from .streaming import SourceMap, StreamingController, source_map, stats
from .streaming.depth import planning_depth
from .streaming.options import STRATEGIES, StreamOptions
from .streaming.preflight import auto_budget
from .streaming.resident import ALL, Residency

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    """The model directory has tokenizer files."""
    return any((Path(path) / f).exists() for f in _TOKENIZER_FILES)


@dataclass(frozen=True)
class MlxLmArgs:
    """``mlx_lm.load``'s arguments (and ``mlx_lm.utils.load_model``'s ``strict`` and
    ``get_model_classes``) as :func:`load_model` received them."""

    tokenizer_config: dict[str, Any] | None = None
    model_config: dict[str, Any] | None = None
    adapter_path: str | os.PathLike[str] | None = None
    lazy: bool = False
    return_config: bool = False
    revision: str | None = None
    trust_remote_code: bool = False
    strict: bool = True
    get_model_classes: Callable[[dict], tuple[type, type]] | None = None


def load_model(
    path_or_hf_repo: str | os.PathLike[str],
    *,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    adapter_path: str | os.PathLike[str] | None = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
    strict: bool = True,
    get_model_classes: Callable[[dict], tuple[type, type]] | None = None,
    resident: Residency | float | str | set[int] | list | None = None,
    options: StreamOptions | None = None,
    engine: str = "auto",
    kernels: str | None = None,
    group: Distribution | Any = None,
    head: str | None = None,
    tokenizer: bool = True,
    engine_args: Mapping[str, Any] | None = None,
):
    """Load a model as ``mlx_lm.load`` does, with a resident set and the rest streamed.

    Called like ``mlx_lm.load(path)``, it returns what that returns. A streamed model
    reads its files for as long as it lives: they must stay on disk (a file replaced or
    truncated under it raises ``OSError(ESTALE)`` at its next read).

    Args:
        path_or_hf_repo: An mlx-lm model directory, a head bundle (``pyloader heads
            build``), another engine's model directory, or a Hugging Face repo id (the
            local hub cache first, then a download unless ``HF_HUB_OFFLINE`` is set).
        tokenizer_config, model_config, adapter_path, lazy, return_config, revision,
            trust_remote_code: ``mlx_lm.load``'s arguments, with its defaults and
            meanings. ``lazy=False`` evaluates the resident parameters; streamed ones
            are read when their layer runs. An adapter applies to resident and
            streamed layers alike.
        strict, get_model_classes: ``mlx_lm.utils.load_model``'s. ``strict=False``: the
            parameters the checkpoint lacks keep their initial values, and a directory
            without weights gives the initialized model.
        resident: The layers kept in memory: a fraction (``0.5``, ``"50%"``, ``"all"``),
            a count (``"4layers"``), a byte budget (``"600MB"``), a set of indices,
            ``"auto"``, or with ``group`` one value per rank. Default:
            ``options.resident`` (every layer); both given must agree.
        options: The other streaming settings (:class:`pyloader.StreamOptions`).
        engine: ``"auto"`` detects an mlx-vlm, mlx-whisper or mlx-embeddings model and
            builds it with that engine (its loader's return value is returned);
            ``"mlx_lm"``, ``"mlx_vlm"``, ``"mlx_whisper"``, ``"mlx_embeddings"`` name it.
        kernels: ``"auto"``: pyloader's CPU kernels compute the linear layers on the CPU;
            ``"mlx"``: MLX's ops, bit-identical to ``mlx_lm.load``. Default:
            ``$PYLOADER_KERNELS``, else ``"auto"``.
        group: An ``mx.distributed.Group`` or a :class:`pyloader.Distribution`: shard as
            mlx-lm does and load only this rank's part.
        head: A head bundle's head to start with (default: its first).
        tokenizer: Load the tokenizer (or processor) too, when the model has one.
        engine_args: Keywords for another engine's loader (mlx-whisper's ``dtype``,
            mlx-vlm's and mlx-embeddings' own). A mapping rather than named parameters:
            each engine takes different ones, and none applies to an mlx-lm model.

    Returns:
        ``(model, tokenizer)``, or ``(model, tokenizer, config)`` with ``return_config``
        (``tokenizer`` None without tokenizer files or with ``tokenizer=False``); another
        engine's model as its loader returns it. ``pyloader.stats(model)`` reports the
        streaming.

    Raises:
        TypeError: a second positional argument, or a keyword not named above.
        ValueError: settings that cannot combine (each named).
        pyloader.ModelNotFoundError: no such directory or repo (and no download).
        pyloader.GGUFFileError: a GGUF file (the message names ``pyloader convert-gguf``).
        pyloader.ConfigError: a ``config.json`` no model can be built from, or that
            describes more than the checkpoint holds (checked before mlx-lm reads it).
        FileNotFoundError: no safetensors, with ``strict=True``.
        MemoryError: the load cannot fit in memory (before anything is read).
        pyloader.EngineNotInstalledError: another engine's model, not installed.
    """
    options = _stream_options(options, resident)
    dist = Distribution.of(group)
    kernels = default_choice() if kernels is None else check_choice(kernels)
    path, chosen = _locate(path_or_hf_repo, engine, revision)
    mlx_lm_args = MlxLmArgs(tokenizer_config, model_config, adapter_path, lazy, return_config,
                            revision, trust_remote_code, strict, get_model_classes)
    if chosen in OTHER_ENGINES:
        _refuse_mlx_lm_only(path, chosen, adapter_path=adapter_path, return_config=return_config,
                            get_model_classes=get_model_classes, group=dist, head=head)
        return _load_with_engine(path, chosen, options, kernels, processor=tokenizer,
                                 mlx_lm_args=mlx_lm_args, engine_args=engine_args)
    require_mlx_lm("pyloader.load_model")
    _refuse_combinations(path, options, dist, head, mlx_lm_args=mlx_lm_args,
                         engine_args=engine_args)
    gguf = is_gguf(path)
    if gguf and effective_choice(kernels) == "mlx":
        return _returned(*_gguf_for_mlx(path, options, model_config), path,
                         tokenizer=tokenizer, mlx_lm_args=mlx_lm_args)
    build = _skeleton_builder(mlx_lm_args)
    t0 = time.perf_counter()
    bundle = BundleLoad(path, head) if head is not None or is_bundle(path) else None
    if bundle is None and not has_weights(path):
        model, config = _initialized_model(path, build, model_config, strict=strict,
                                           lazy=lazy)
        if adapter_path is not None:
            model = _adapted(model, adapter_path)
    else:
        ckpt, model, config, metas = _skeleton(path, bundle, build, model_config, strict)
        share, resident = _shard(model, ckpt, dist, options)
        # A GGUF's tensors come under the model's own names: nothing to sanitize.
        sources = source_map(model, metas, dict if gguf else None)
        sources, ckpt, given, resident = _sources(model, ckpt, sources, share, bundle,
                                                  resident, options, strict=strict)
        controller = StreamingController(ckpt, options.with_(resident=resident))
        # Called from here: the warnings of the layers below name the caller's line.
        controller.attach(model, sources.direct, given, started=t0, strict=strict)
        if adapter_path is not None:
            model = _adapted(model, adapter_path, controller)
        if not lazy and not options.overlap:
            mx.eval(controller.in_memory(model))  # not the streamed units' stand-ins
        for part in (share, bundle):
            if part is not None:
                part.finish(model)
    log.info("%s", install_kernels(model, kernels).summary())
    return _returned(model, config, path, tokenizer=tokenizer, mlx_lm_args=mlx_lm_args)


def _gguf_for_mlx(path: Path, options: StreamOptions,
                  model_config: dict[str, Any] | None) -> tuple[Any, dict]:
    """A GGUF model for MLX's ops (kernels="mlx", or a GPU): its block tensors are rewritten
    into MLX's format in memory, so every layer and expert is resident."""
    if not options.resident.keeps_all or options.experts != "layer":
        raise ValueError(f"{path}: with MLX's ops a GGUF file's block tensors are rewritten "
                         "into MLX's format in memory, so its layers and experts cannot "
                         "stream: load it resident, or with kernels='auto' on the CPU "
                         "(computed in place)")
    source = GGUFSource.open(path)
    return gguf_load_for_mlx(source, model_config), source.config


def _stream_options(options: StreamOptions | None, resident: Any) -> StreamOptions:
    """``options`` with ``resident`` applied. ``options.resident`` at its default (every
    layer) cannot be told from one set on purpose, so it gives way; any other must agree."""
    if options is None:
        options = StreamOptions()
    elif not isinstance(options, StreamOptions):
        raise TypeError(f"options must be a StreamOptions, not {type(options).__name__}")
    if resident is None:
        return options
    resident = Residency.parse(resident)
    if options.resident != ALL and options.resident != resident:
        raise ValueError(f"resident={resident} and options.resident={options.resident} "
                         "disagree: give the resident set once")
    return options.with_(resident=resident)


def _locate(path_or_hf_repo: str | os.PathLike[str], engine: str,
            revision: str | None) -> tuple[Path, str]:
    """The model directory and the engine that builds it (the engine's name checked
    before anything is looked up)."""
    chosen = check_engine(engine)
    path = resolve(path_or_hf_repo, revision)
    if is_gguf(path):
        if chosen not in ("auto", "mlx_lm"):
            raise ValueError(f"{path} is a GGUF file, which pyloader builds as an mlx-lm "
                             f"model, not with engine={engine!r}")
        return path, "mlx_lm"
    refuse_gguf(path)  # a directory whose weights are a GGUF file: name the file
    return path, detect(path) if chosen == "auto" else chosen


def _refuse_mlx_lm_only(path: Path, engine: str, **given: Any) -> None:
    """ValueError naming the arguments given that only an mlx-lm model takes."""
    named = [k for k, v in given.items() if v not in (None, False)]
    if named:
        raise ValueError(f"{path} is an {engine} model: {', '.join(named)} apply to "
                         "mlx-lm models only")


def _load_with_engine(path: Path, engine: str, options: StreamOptions, kernels: str, *,
                      processor: bool, mlx_lm_args: MlxLmArgs,
                      engine_args: Mapping[str, Any] | None):
    """Another engine's model (:func:`pyloader.engines.load`), with the kernels."""
    a = mlx_lm_args
    extra = {k: v for k, v in (("model_config", a.model_config),
                               ("tokenizer_config", a.tokenizer_config)) if v}
    result = load_engine_model(path, engine, options, strict=a.strict, lazy=a.lazy,
                               processor=processor, **extra, **(engine_args or {}))
    model = result[0] if isinstance(result, tuple) else result
    log.info("%s", install_kernels(model, kernels).summary())
    return result


def _refuse_combinations(path: Path, options: StreamOptions, dist: Distribution | None,
                         head: str | None, *, mlx_lm_args: MlxLmArgs,
                         engine_args: Mapping[str, Any] | None) -> None:
    """ValueError for settings an mlx-lm load cannot combine, before anything is read."""
    a = mlx_lm_args
    if engine_args:
        raise ValueError(f"{path} is an mlx-lm model: engine_args apply to other engines' "
                         "models only")
    if dist is not None and dist.shard == "tensor" and options.caches_experts:
        raise ValueError("shard='tensor' reads slices of the stacked expert tensors, which "
                         "expert caches (experts=...) cannot hold; use experts='layer'")
    if dist is None and options.resident.kind == "per_rank":
        raise ValueError(f"resident={options.resident} gives one value per rank of a "
                         "distributed group: pass group=, or one value")
    if a.adapter_path is not None and options.caches_experts:
        raise ValueError("adapter_path cannot be combined with expert caches (experts=...); "
                         "use experts='layer'")
    if is_gguf(path):
        given = {"group": dist, "head": head, "adapter_path": a.adapter_path,
                 "get_model_classes": a.get_model_classes}
        named = [k for k, v in given.items() if v is not None]
        if named or not a.strict:
            raise ValueError(f"{path} is a GGUF file: {', '.join(named) or 'strict=False'} "
                             "apply to model directories only")
        return
    if head is None and not is_bundle(path):
        return
    if dist is not None:
        raise ValueError(f"{path}: a head bundle cannot be loaded with group= "
                         "(distributed loading takes a plain checkpoint)")
    if not options.resident.keeps_all:
        raise ValueError("head bundles load fully resident (resident=1.0)")
    if a.model_config or a.get_model_classes is not None or not a.strict:
        raise ValueError(f"{path}: a head bundle takes none of model_config, "
                         "get_model_classes, strict=False")


def _skeleton_builder(mlx_lm_args: MlxLmArgs) -> Callable[..., tuple]:
    """``mlx_lm.utils.load_model`` with the caller's model arguments bound (its own
    ``get_model_classes`` unless one is given)."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    a = mlx_lm_args
    bound: dict[str, Any] = {"model_config": a.model_config,
                             "trust_remote_code": a.trust_remote_code}
    if a.get_model_classes is not None:
        bound["get_model_classes"] = a.get_model_classes
    return functools.partial(mlx_lm_load_model, **bound)


def _initialized_model(path: Path, build: Callable[..., tuple],
                       model_config: dict[str, Any] | None, *, strict: bool,
                       lazy: bool) -> tuple[Any, dict]:
    """A directory without weights: FileNotFoundError, or with ``strict=False`` the
    initialized model as mlx-lm gives it (nothing to read, so nothing to stream)."""
    if strict:
        raise FileNotFoundError(f"No safetensors found in {path}")
    check_config(path, model_config=model_config, strict=False)
    model, config = build(path, lazy=lazy, strict=False)
    log.info("%s has no weights: the model keeps its initial values", path)
    return model, config


def _skeleton(path: Path, bundle: BundleLoad | None, build: Callable[..., tuple],
              model_config: dict[str, Any] | None, strict: bool):
    """``(checkpoint, model, config, tensors)``: the model's structure from mlx-lm
    itself, its lazy ``mx.load`` arrays never evaluated (they are replaced). A repacked
    checkpoint's padding entries are not parameters: mlx-lm skips them here
    (``strict=False``) and the controller's strict load checks everything else."""
    if bundle is not None:
        from mlx_lm.utils import load_config

        return bundle.checkpoint, bundle.skeleton(), load_config(path), bundle.tensors()
    if is_gguf(path):
        source = GGUFSource.open(path)
        model = gguf_skeleton(source, model_config)
        return source.checkpoint, model, source.config, source.checkpoint.tensors()
    ckpt = Checkpoint(path)
    check_config(path, ckpt, model_config=model_config, strict=strict)
    model, config = build(path, lazy=True, strict=strict and not ckpt.padding_names)
    return ckpt, model, config, ckpt.tensors()


def _shard(model, ckpt: Checkpoint, dist: Distribution | None, options: StreamOptions):
    """``(share, resident)``: with a group, mlx-lm's sharding applied to ``model`` and
    this rank's resident set; without, the resident set (``"auto"``: the memory's)."""
    resident = options.resident
    if dist is None:
        return None, Residency.of_bytes(auto_budget()) if resident.is_auto else resident
    split = dist.split
    if resident.is_auto and dist.shard == "pipeline" and split is None:
        split = plan_split(ckpt, "auto", group=dist.group,
                           prefetch=planning_depth(options.prefetch))
    check_lockstep(dist.shard, resident)
    share = shard_model(model, dist.group, mode=dist.shard, split=split)
    share.resident = resident.for_rank(share.rank, share.size)
    return share, share.resident


def _sources(model, ckpt: Checkpoint, sources: SourceMap, share, bundle: BundleLoad | None,
             resident: Residency, options: StreamOptions, *, strict: bool):
    """``(sources, checkpoint, given, resident)``: the checkpoint tensor of each
    parameter (only this rank's, or its slices, with a group), the arrays computed or
    read apart (a bundle's head), and the rank's ``"auto"`` resident set."""
    if not strict:
        sources = sources.restrict_to(model)
    if share is not None:
        sources, ckpt = share.restrict(model, sources, ckpt)
        if resident.is_auto:
            resident = share.auto_resident(sources.direct, planning_depth(options.prefetch))
    given = sources.compute_derived(model, ckpt)
    if bundle is not None:
        sources, head_arrays = bundle.take_head(sources)
        given.update(head_arrays)
    return sources, ckpt, given, resident


def _adapted(model, adapter_path: str | os.PathLike[str],
             controller: StreamingController | None = None):
    """``model`` with mlx-lm's adapter applied (over the resident and streamed layers
    alike when a controller streams some)."""
    from mlx_lm.utils import load_adapters

    if controller is None:
        model = load_adapters(model, os.fspath(adapter_path))
    else:
        check_adapter(adapter_path, streams=bool(controller.layout.units))
        with controller.restructuring(model):
            model = load_adapters(model, os.fspath(adapter_path))
    model.eval()
    return model


def has_weights(path: Path) -> bool:
    """``path`` is a safetensors file or a directory holding one (or an index)."""
    if path.is_file():
        return True
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()


def check_adapter(adapter_path: str | os.PathLike[str], *, streams: bool) -> None:
    """ValueError for an adapter pyloader cannot apply to a model whose layers stream: a
    full fine-tune (``fine_tune_type: "full"``) replaces the weights the streamed layers
    would read back from the checkpoint."""
    import json

    cfg = Path(adapter_path) / "adapter_config.json"
    if not streams or not cfg.is_file():
        return  # mlx-lm's own errors name a missing adapter
    with open(cfg) as f:
        kind = json.load(f).get("fine_tune_type", "lora")
    if kind == "full":
        raise ValueError(
            f"{adapter_path}: a full fine-tune adapter replaces the model's weights, but "
            "streamed layers read theirs from the checkpoint: load it with resident=1.0, "
            "or fuse it into a checkpoint (mlx_lm.fuse) and load that")


def _returned(model, config: dict, path: Path, *, tokenizer: bool, mlx_lm_args: MlxLmArgs):
    """What ``mlx_lm.load`` returns: the model, the tokenizer (with the config's EOS ids,
    as mlx-lm builds it; None without tokenizer files or with ``tokenizer=False``) and,
    with ``return_config``, the config."""
    from mlx_lm.utils import load_tokenizer

    if not tokenizer:
        tok = None
    elif is_gguf(path):
        tok = GGUFSource.open(path).tokenizer(mlx_lm_args.tokenizer_config)
    else:
        tok = (load_tokenizer(path, mlx_lm_args.tokenizer_config,
                              eos_token_ids=config.get("eos_token_id"))
               if has_tokenizer(path) else None)
    return (model, tok, config) if mlx_lm_args.return_config else (model, tok)


__all__ = ["STRATEGIES", "Distribution", "Residency",
           "StreamOptions", "has_tokenizer", "load_model", "stats"]
