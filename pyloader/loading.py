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
    [finish]             group=: the ranks synchronize; bundle: swap_head & co.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from ._util.optional import require_mlx_lm
from .distributed import Distribution, check_lockstep, plan_split, shard_model
from .engines import OTHER_ENGINES, check_engine, detect
from .engines import load as load_engine_model
from .heads import BundleLoad, is_bundle
from .io.checkpoint import Checkpoint, refuse_gguf
from .io.config import check_config
from .io.hub import resolve
from .kernels import check_choice, default_choice
from .kernels import install as install_kernels
from .streaming import StreamingController, source_map, stats
from .streaming.depth import planning_depth
from .streaming.options import STRATEGIES, StreamOptions
from .streaming.preflight import auto_budget
from .streaming.resident import ALL, Residency

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    """The model directory has tokenizer files."""
    return any((Path(path) / f).exists() for f in _TOKENIZER_FILES)


#: ``mlx_lm.load``'s and ``mlx_lm.utils.load_model``'s own arguments, which ``load_model``
#: takes by name and passes on as mlx-lm takes them (``**mlx_lm_args``), with defaults.
MLX_LM_ARGS: dict[str, Any] = {
    "tokenizer_config": None,
    "model_config": None,
    "adapter_path": None,
    "lazy": False,
    "return_config": False,
    "revision": None,
    "trust_remote_code": False,
    "strict": True,
    "get_model_classes": None,
}

def load_model(
    path_or_hf_repo: str | os.PathLike[str],
    *,
    resident: Residency | float | str | set[int] | list | None = None,
    options: StreamOptions | None = None,
    engine: str = "auto",
    kernels: str | None = None,
    group: Distribution | Any = None,
    head: str | None = None,
    tokenizer: bool = True,
    **mlx_lm_args: Any,
):
    """Load an mlx-lm model with a resident set and the rest streamed from disk.

    Called like ``mlx_lm.load(path)``, it returns what that returns; every other argument
    is a keyword. A streamed model reads its files for as long as it lives: they must
    stay on disk (a file replaced or truncated under it raises ``OSError(ESTALE)`` at its
    next read).

    Args:
        path_or_hf_repo: mlx-lm model directory (``config.json`` + safetensors), a head
            bundle (``pyloader heads build``), or a Hugging Face repo id (``"org/name"``)
            found in the local hub cache (``HF_HUB_CACHE`` / ``HF_HOME``), downloaded with
            huggingface_hub unless ``HF_HUB_OFFLINE`` is set (:mod:`pyloader.io.hub`).
        resident: Layers kept in memory, the rest streamed: a fraction (``0.5``,
            ``"50%"``, ``"all"``), a count (``4``, ``"4layers"``), a byte budget for all
            weights (``"600MB"``), a set of layer indices, ``"auto"``, or with ``group``
            a list with one value per rank; the rules are
            :class:`pyloader.streaming.StreamOptions`'. Default: ``options.resident``
            (every layer). Given both here and as a non-default ``options.resident``, the
            two must be the same set (ValueError otherwise).
        options: Every streaming setting (:class:`pyloader.streaming.StreamOptions`:
            strategy, placement, granularity, prefetch, page cache, read backend, expert
            caches, overlap), checked when built; default ``StreamOptions()``.
        engine: ``"auto"`` (default): an mlx-vlm, mlx-whisper or mlx-embeddings
            directory (:func:`pyloader.engines.detect`) is built by that engine and
            returned as its loader returns it (:func:`pyloader.engines.load`, with
            ``strict``, ``lazy``, ``model_config``, ``tokenizer_config`` and the
            streaming settings and ``kernels``; docs/engines.md); anything else by mlx-lm. A
            directory with a vision or audio tower never loads as mlx-lm's text-only
            model unless ``engine="mlx_lm"`` is given. ``"mlx_lm"``, ``"mlx_vlm"``,
            ``"mlx_whisper"``, ``"mlx_embeddings"``: that engine, without detection.
        kernels: ``"auto"``: the model's linear layers compute with pyloader's CPU kernels
            when they run on the CPU (SIMD, every core, float32 accumulation; see
            :mod:`pyloader.kernels` for what they cover); ``"mlx"``: MLX's own ops, with
            results bit-identical to ``mlx_lm.load``'s. Default: ``$PYLOADER_KERNELS``,
            else ``"auto"``.
        group: An ``mx.distributed.Group`` (pipeline sharding, mlx-lm's even split) or a
            :class:`pyloader.distributed.Distribution` (``Distribution(group,
            shard="tensor")``, ``Distribution(group, split=[20, 12])``): apply mlx-lm's
            sharding and load/stream only this rank's part. See
            :mod:`pyloader.distributed`.
        head: For a head bundle: the head to start with (default: the bundle's
            first). The model is then fully resident and gains
            ``swap_head``/``preload_heads``; see :mod:`pyloader.heads`.
        tokenizer: Load the tokenizer too, when the checkpoint has one.
        **mlx_lm_args: mlx-lm's own arguments, as ``mlx_lm.load`` and
            ``mlx_lm.utils.load_model`` take them:

            * ``tokenizer_config``: extra tokenizer settings;
            * ``model_config``: entries that override the model's ``config.json``;
            * ``adapter_path``: a LoRA/DoRA adapter directory (``adapter_config.json`` +
              ``adapters.safetensors``), applied as mlx-lm applies it, on top of resident
              and streamed layers alike;
            * ``lazy``: False (as mlx-lm): every resident parameter is evaluated before
              returning (streamed ones come in when their layer runs); True: left to
              first use;
            * ``return_config``: also return the model's config;
            * ``revision``: with a repo id, a branch, tag or commit of the hub repo;
            * ``trust_remote_code``: allow a config's ``model_file`` (custom Python) to
              define the architecture;
            * ``strict``: every parameter must come from the checkpoint (False, as in
              mlx-lm: the others keep their initial values, tensors that match no
              parameter are ignored, and a directory without weights gives the
              initialized model);
            * ``get_model_classes``: ``config -> (Model, ModelArgs)`` (default: mlx-lm's
              registry).

    Returns:
        ``(model, tokenizer)``, or ``(model, tokenizer, config)`` with ``return_config``;
        ``tokenizer`` is None when the checkpoint has no tokenizer files (or
        ``tokenizer=False``). ``pyloader.stats(model)`` reports streaming counters.

    Raises:
        TypeError: a second positional argument (``mlx_lm.load``'s positional order is
            not taken: pass its arguments by name), or a keyword that is none of the
            above, named with the ones allowed.
        pyloader.ModelNotFoundError: neither a local path nor a repo in the hub cache
            (and nothing may be downloaded).
        pyloader.GGUFFileError: the path is a GGUF file, or a directory whose only
            weights are one (the message names ``pyloader convert-gguf``, which makes a
            model directory of it).
        pyloader.ConfigError: ``config.json`` holds a size no model can be built from
            (whatever ``strict`` is), or describes more layers or parameters than the
            checkpoint holds; its ``model_file`` leads outside the model directory; it
            (or a file mlx-lm reads beside it) is not a regular file. Checked before
            mlx-lm builds the skeleton, on every path (:mod:`pyloader.io.config`).
        MemoryError: the load cannot fit in the memory available (before anything is
            read; the message names settings that fit).
        pyloader.EngineNotInstalledError: the directory is another engine's model and
            that engine is not installed (the message names the package).
    """
    args = _mlx_lm_args(mlx_lm_args)
    options = _stream_options(options, resident)
    dist = Distribution.of(group)
    kernels = default_choice() if kernels is None else check_choice(kernels)
    chosen = check_engine(engine)
    path = resolve(path_or_hf_repo, args["revision"])
    refuse_gguf(path)
    if chosen == "auto":
        chosen = detect(path)
    if chosen in OTHER_ENGINES:
        given = [k for k in ("adapter_path", "return_config", "get_model_classes")
                 if args[k] not in (None, False)] + [k for k, v in (("group", dist),
                                                                   ("head", head)) if v]
        if given:
            raise ValueError(f"{path} is an {chosen} model: {', '.join(given)} apply to "
                             "mlx-lm models only")
        extra = {k: args[k] for k in ("model_config", "tokenizer_config") if args[k]}
        result = load_engine_model(path, chosen, options, strict=args["strict"],
                                   lazy=args["lazy"], processor=tokenizer, **extra)
        model = result[0] if isinstance(result, tuple) else result
        log.info("%s", install_kernels(model, kernels).summary())
        return result
    # The warnings of the layers below name the caller's line (a fixed stack depth): the
    # mlx-lm load stays in this function.
    require_mlx_lm("pyloader.load_model")
    from mlx_lm.utils import load_adapters, load_config
    from mlx_lm.utils import load_model as mlx_lm_load_model

    resident = options.resident
    model_config, adapter_path = args["model_config"], args["adapter_path"]
    lazy, strict = args["lazy"], args["strict"]
    get_model_classes = args["get_model_classes"]
    if dist is not None and dist.shard == "tensor" and options.caches_experts:
        raise ValueError("shard='tensor' reads slices of the stacked expert tensors, which "
                         "expert caches (experts=...) cannot hold; use experts='layer'")
    if dist is None and resident.kind == "per_rank":
        raise ValueError(f"resident={resident} gives one value per rank of a distributed "
                         "group: pass group=, or one value")
    if adapter_path is not None and options.caches_experts:
        raise ValueError("adapter_path cannot be combined with expert caches (experts=...); "
                         "use experts='layer'")
    t0 = time.perf_counter()
    skeleton_args: dict[str, Any] = {"model_config": model_config,
                                     "trust_remote_code": args["trust_remote_code"]}
    if get_model_classes is not None:
        skeleton_args["get_model_classes"] = get_model_classes
    finish = {"tokenizer": tokenizer, "tokenizer_config": args["tokenizer_config"],
              "return_config": args["return_config"], "kernels": kernels}
    bundle = None
    if head is not None or is_bundle(path):
        if dist is not None:
            raise ValueError(f"{path}: a head bundle cannot be loaded with group= "
                             "(distributed loading takes a plain checkpoint)")
        if not resident.keeps_all:
            raise ValueError("head bundles load fully resident (resident=1.0)")
        if model_config or get_model_classes is not None or not strict:
            raise ValueError(f"{path}: a head bundle takes none of model_config, "
                             "get_model_classes, strict=False")
        bundle = BundleLoad(path, head)
    elif not has_weights(path):
        if strict:
            raise FileNotFoundError(f"No safetensors found in {path}")
        # As mlx-lm: the initialized model; nothing to read, so nothing to stream.
        check_config(path, model_config=model_config, strict=False)
        model, config = mlx_lm_load_model(path, lazy=lazy, strict=False, **skeleton_args)
        log.info("%s has no weights: the model keeps its initial values", path)
        return _finish(model, config, path, adapter_path=adapter_path, **finish)

    # The lazy skeleton: the model's structure (config, quantization) from mlx-lm
    # itself; its lazy mx.load arrays are never evaluated and are replaced below. A
    # repacked checkpoint's padding entries are not parameters: mlx-lm skips them here
    # (strict=False) and the controller's strict load_weights checks everything else.
    if bundle is not None:
        ckpt, model, metas = bundle.checkpoint, bundle.skeleton(), bundle.tensors()
        config = load_config(path)
    else:
        ckpt = Checkpoint(path)
        check_config(path, ckpt, model_config=model_config, strict=strict)
        model, config = mlx_lm_load_model(path, lazy=True,
                                          strict=strict and not ckpt.padding_names,
                                          **skeleton_args)
        metas = ckpt.tensors()
    share = None
    split = None if dist is None else dist.split
    if dist is not None:
        if resident.is_auto and dist.shard == "pipeline" and split is None:
            split = plan_split(ckpt, "auto", group=dist.group,
                               prefetch=planning_depth(options.prefetch))
        check_lockstep(dist.shard, resident)
        share = shard_model(model, dist.group, mode=dist.shard, split=split)
        resident = share.resident = resident.for_rank(share.rank, share.size)
    elif resident.is_auto:
        resident = Residency.of_bytes(auto_budget())
    sources = source_map(model, metas)
    if not strict:
        sources = sources.restrict_to(model)
    if share is not None:  # only this rank's tensors (or slices) from here on
        sources, ckpt = share.restrict(model, sources, ckpt)
        if resident.is_auto:
            resident = share.auto_resident(sources.direct, planning_depth(options.prefetch))
    given = sources.compute_derived(model, ckpt)
    if bundle is not None:
        sources, head_arrays = bundle.take_head(sources)
        given.update(head_arrays)

    controller = StreamingController(ckpt, options.with_(resident=resident))
    controller.attach(model, sources.direct, given, started=t0, strict=strict)
    if adapter_path is not None:
        check_adapter(adapter_path, streams=bool(controller.layout.units))
        with controller.restructuring(model):
            model = load_adapters(model, os.fspath(adapter_path))
        model.eval()
    if not lazy and not options.overlap:
        mx.eval(controller.in_memory(model))  # not the streamed units' stand-ins

    if share is not None:
        share.finish(model)
    if bundle is not None:
        bundle.finish(model)
    return _finish(model, config, path, adapter_path=None, **finish)


def _mlx_lm_args(given: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's arguments with their defaults; TypeError for a name that is not one,
    saying where a streaming or distributed setting goes."""
    unknown = [k for k in given if k not in MLX_LM_ARGS]
    if unknown:
        streaming = [k for k in unknown if k in StreamOptions.__dataclass_fields__]
        sharding = [k for k in unknown if k in ("shard", "split")]
        where = ""
        if streaming:
            where += (f"; {', '.join(streaming)} {'is a' if len(streaming) == 1 else 'are'} "
                      f"streaming setting{'s' if len(streaming) > 1 else ''}: pass "
                      f"options=StreamOptions({streaming[0]}=...)")
        if sharding:
            where += (f"; {', '.join(sharding)} go{'es' if len(sharding) == 1 else ''} in "
                      f"group=Distribution(group, {sharding[0]}=...)")
        raise TypeError(f"load_model() got unexpected keyword argument"
                        f"{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                        f"{where}; it takes resident, options, engine, kernels, group, head, "
                        f"tokenizer and mlx-lm's own {', '.join(MLX_LM_ARGS)}")
    return {**MLX_LM_ARGS, **given}


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


def _finish(model, config, path: Path, *, tokenizer: bool, tokenizer_config, adapter_path,
            return_config: bool, kernels: str):
    """Adapters (for a model built without pyloader's controller), the kernels, the
    tokenizer (with the config's EOS ids, as mlx-lm) and the return value."""
    from mlx_lm.utils import load_adapters, load_tokenizer

    if adapter_path is not None:
        model = load_adapters(model, os.fspath(adapter_path))
        model.eval()
    log.info("%s", install_kernels(model, kernels).summary())
    tok = (load_tokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
           if tokenizer and has_tokenizer(path) else None)
    return (model, tok, config) if return_config else (model, tok)


__all__ = ["MLX_LM_ARGS", "STRATEGIES", "Distribution", "Residency",
           "StreamOptions", "has_tokenizer", "load_model", "stats"]
