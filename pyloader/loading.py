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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from ._util.optional import require_mlx_lm
from .distributed import check_lockstep, plan_split, rank_value, shard_model
from .engines import OTHER_ENGINES, check_engine, detect
from .engines import load as load_engine_model
from .heads import BundleLoad, is_bundle
from .io.checkpoint import Checkpoint
from .io.config import check_config
from .io.hub import resolve
from .kernels import check_choice, default_choice
from .kernels import install as install_kernels
from .streaming import StreamingController, source_map, stats
from .streaming.depth import planning_depth
from .streaming.options import STRATEGIES, StreamOptions
from .streaming.preflight import auto_budget

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    """The model directory has tokenizer files."""
    return any((Path(path) / f).exists() for f in _TOKENIZER_FILES)


def load_model(
    path_or_hf_repo: str | os.PathLike[str],
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    adapter_path: str | os.PathLike[str] | None = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
    *,
    strict: bool = True,
    get_model_classes: Callable | None = None,
    strategy: str = "mmap",
    resident: float | str = 1.0,
    placement: str = "first_n",
    granularity: str = "layer",
    prefetch: int | str = "auto",
    keep_page_cache: bool = False,
    read_backend: str = "threads",
    tokenizer: bool = True,
    group=None,
    shard: str = "pipeline",
    split=None,
    head: str | None = None,
    experts: Any = "layer",
    expert_policy: str = "lru",
    expert_source: str = "bank",
    overlap: bool = False,
    kernels: str | None = None,
    engine: str = "auto",
):
    """Load an mlx-lm model with a resident set and the rest streamed from disk.

    The positional arguments are ``mlx_lm.load``'s, in its order, with its meaning, so an
    engine can call one in place of the other; pyloader's own settings are keywords.
    A streamed model reads its files for as long as it lives: they must stay on disk
    (a file replaced or truncated under it raises ``OSError(ESTALE)`` at its next read).

    Args:
        path_or_hf_repo: mlx-lm model directory (``config.json`` + safetensors), a head
            bundle (``pyloader heads build``), or a Hugging Face repo id (``"org/name"``)
            found in the local hub cache (``HF_HUB_CACHE`` / ``HF_HOME``), downloaded with
            huggingface_hub unless ``HF_HUB_OFFLINE`` is set (:mod:`pyloader.io.hub`).
        tokenizer_config: Extra tokenizer settings, as ``mlx_lm.load`` takes them.
        model_config: Entries that override the model's ``config.json``.
        adapter_path: A LoRA/DoRA adapter directory (``adapter_config.json`` +
            ``adapters.safetensors``, as mlx-lm's trainer writes it), applied the way
            ``mlx_lm.load`` applies it, on top of resident and streamed layers alike.
        lazy: False (as mlx-lm): every resident parameter is evaluated before returning
            (streamed ones come in when their layer runs); True: left to first use.
        return_config: Also return the model's config: ``(model, tokenizer, config)``.
        revision: With a repo id: a branch, tag or commit of the hub repo.
        trust_remote_code: Allow a config's ``model_file`` (custom Python) to define the
            architecture, as mlx-lm does.
        strict: Every parameter must come from the checkpoint (False, as in mlx-lm: the
            others keep their initial values, tensors that match no parameter are
            ignored, and a directory without weights gives the initialized model).
        get_model_classes: ``config -> (Model, ModelArgs)``, as mlx-lm's ``load_model``
            takes it (default: mlx-lm's registry).
        strategy: ``"mmap"`` or ``"pread"``: where streamed (and resident) weights come from.
        resident: Layers kept in memory: a count (int, or a str with its unit:
            ``"4layers"``), a fraction (float in [0, 1], or ``"50%"``, ``"all"``), a byte
            budget for all weights (a str with its unit: ``"600MB"``, ``"4096B"``) or
            a set of layer indices (e.g. ``pyloader.residency.plan(...).resident_layers``),
            or ``"auto"``. ``1`` (the int) keeps ONE layer and warns
            (:class:`pyloader.ResidencyWarning`) that every layer is ``1.0`` or ``"all"``
            (``"1layer"`` says one layer without the warning); a bare number in a str
            (``"3"``: layers or bytes?) raises ValueError. ``"auto"`` is a byte
            budget of this process's headroom now, page cache counted as used, minus the
            pre-flight reserve
            (:func:`pyloader.streaming.preflight.auto_budget`; ``PYLOADER_HEADROOM``
            clamps the headroom). With ``group``, every rank measures its own and the
            budgets are gathered: ``shard="pipeline"`` without ``split`` chooses the
            split from them (``distributed.plan_split(path, "auto", group=)``, the same
            on every rank) and each rank keeps what its own budget holds;
            ``shard="tensor"`` applies the smallest rank's budget on every rank (tensor
            ranks must stream the same layers; per-rank lists must then be equal). A
            rank that cannot fit makes every rank raise ``MemoryError`` before anything
            is read.
            Non-layer weights (embeddings, final norm, lm_head) are always resident. The
            layers are ``model.layers``, or for a model without it the longest list of
            same-type modules; a model with neither is loaded fully resident.
        placement: Which layers are resident: ``"first_n"``, ``"last_n"`` or
            ``"interleaved"`` (spread evenly).
        granularity: ``"layer"`` streams whole layers; ``"sublayer"`` streams each
            layer's attention and MLP blocks separately (small norms stay resident).
        prefetch: How many streamed units ahead to bring in while the current one
            computes (0 disables prefetching), or ``"auto"`` (the default): the depth
            the units' sizes call for (1 for layers, deeper where units alternate in
            size, as at ``granularity="sublayer"``), lowered to what fits the memory
            headroom; ``pyloader.stats(model)["prefetch"]`` tells the depth chosen
            (:mod:`pyloader.streaming.depth`).
        keep_page_cache: Keep released units in the page cache (drop them from this
            process only).
        read_backend: pread only: ``"threads"`` or ``"io_uring"``.
        tokenizer: Load the tokenizer too, when the checkpoint has one.
        group: An ``mx.distributed.Group``: apply mlx-lm's sharding and load/stream
            only this rank's part (``resident`` may then be a list with one value per
            rank). See :mod:`pyloader.distributed`.
        shard: With ``group``: ``"pipeline"`` (this rank's layers) or ``"tensor"``
            (mlx-lm's ``model.shard(group)``: every layer, and of each sharded
            parameter only this rank's slice is read).
        split: With ``group`` and ``shard="pipeline"``: layers per rank (rank 0 runs
            the last layers), a ``distributed.SplitPlan``, or None for mlx-lm's even
            split.
        head: For a head bundle: the head to start with (default: the bundle's
            first). The model is then fully resident and gains
            ``swap_head``/``preload_heads``; see :mod:`pyloader.heads`.
        experts: Mixture-of-experts models: ``"layer"`` (default) streams experts with
            their layer; otherwise each MoE module reads only the experts its tokens route
            to into a fixed cache (:mod:`pyloader.streaming.experts`): slots per layer
            (int), a fraction of each layer's experts (float in (0, 1]) or a byte budget
            for every cache together (str). The rest of each layer follows ``resident``.
        expert_policy: The expert caches' eviction policy: ``"lru"`` or ``"lfu"``.
        expert_source: Where cached experts live: ``"bank"`` (default: fixed slots read
            with parallel pread) or ``"mmap"`` (page-cache views of the stacked tensors,
            each expert's pages populated when it enters and dropped when it leaves; needs
            an aligned checkpoint, see ``pyloader repack``).
        overlap: Return while the resident weights are still being read, in file order,
            in the background, so the reads overlap the first forward pass: with
            ``"pread"`` each array waits for its own tensor's bytes when evaluated (a
            failed read raises its ``OSError`` there), with ``"mmap"`` the views' pages
            are populated in the background (a fault brings in what is not there yet).
            ``lazy`` is then moot: nothing waits for the resident weights at load.
            Default False: every resident byte is in when ``load_model`` returns
            (docs/loading.md says when each wins).
        kernels: ``"auto"``: the model's linear layers compute with pyloader's CPU kernels
            when they run on the CPU (SIMD, every core, float32 accumulation; see
            :mod:`pyloader.kernels` for what they cover); ``"mlx"``: MLX's own ops, with
            results bit-identical to ``mlx_lm.load``'s. Default: ``$PYLOADER_KERNELS``,
            else ``"auto"``.
        engine: ``"auto"`` (default): an mlx-vlm, mlx-whisper or mlx-embeddings
            directory (:func:`pyloader.engines.detect`) is built by that engine and
            returned as its loader returns it (:func:`pyloader.engines.load`, with
            ``strict``, ``lazy``, ``model_config``, ``tokenizer_config`` and the
            streaming settings; docs/engines.md); anything else by mlx-lm. A
            directory with a vision or audio tower never loads as mlx-lm's text-only
            model unless ``engine="mlx_lm"`` is given. ``"mlx_lm"``, ``"mlx_vlm"``,
            ``"mlx_whisper"``, ``"mlx_embeddings"``: that engine, without detection.

    Returns:
        ``(model, tokenizer)``, or ``(model, tokenizer, config)`` with ``return_config``;
        ``tokenizer`` is None when the checkpoint has no tokenizer files (or
        ``tokenizer=False``). ``pyloader.stats(model)`` reports streaming counters.

    Raises:
        pyloader.ModelNotFoundError: neither a local path nor a repo in the hub cache
            (and nothing may be downloaded).
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
    path = resolve(path_or_hf_repo, revision)
    if (chosen := check_engine(engine)) == "auto":
        chosen = detect(path)
    if chosen in OTHER_ENGINES:
        if adapter_path is not None or group is not None or head is not None or return_config:
            raise ValueError(f"{path} is an {chosen} model: adapter_path, group, head and "
                             "return_config apply to mlx-lm models only")
        extra = {k: v for k, v in (("model_config", model_config),
                                   ("tokenizer_config", tokenizer_config)) if v}
        return load_engine_model(path, chosen, StreamOptions(
            strategy=strategy, resident=resident, placement=placement,
            granularity=granularity, prefetch=prefetch, keep_page_cache=keep_page_cache,
            read_backend=read_backend, experts=experts, expert_policy=expert_policy,
            expert_source=expert_source, overlap=overlap), strict=strict, lazy=lazy,
            processor=tokenizer, **extra)
    require_mlx_lm("pyloader.load_model")
    from mlx_lm.utils import load_adapters, load_config
    from mlx_lm.utils import load_model as mlx_lm_load_model

    options = StreamOptions(strategy=strategy, resident=resident, placement=placement,
                            granularity=granularity, prefetch=prefetch,
                            keep_page_cache=keep_page_cache, read_backend=read_backend,
                            experts=experts, expert_policy=expert_policy,
                            expert_source=expert_source, overlap=overlap)
    if group is not None and shard == "tensor" and experts != "layer":
        raise ValueError("shard='tensor' reads slices of the stacked expert tensors, which "
                         "expert caches (experts=...) cannot hold; use experts='layer'")
    kernels = default_choice() if kernels is None else check_choice(kernels)
    if adapter_path is not None and experts != "layer":
        raise ValueError("adapter_path cannot be combined with expert caches (experts=...); "
                         "use experts='layer'")
    t0 = time.perf_counter()
    skeleton_args: dict[str, Any] = {"model_config": model_config,
                                     "trust_remote_code": trust_remote_code}
    if get_model_classes is not None:
        skeleton_args["get_model_classes"] = get_model_classes
    bundle = None
    if head is not None or is_bundle(path):
        if group is not None:
            raise ValueError(f"{path}: a head bundle cannot be loaded with group= "
                             "(distributed loading takes a plain checkpoint)")
        if resident != 1.0:
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
        return _finish(model, config, path, tokenizer, tokenizer_config, adapter_path,
                       return_config, kernels)

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
    if group is not None:
        if resident == "auto" and shard == "pipeline" and split is None:
            split = plan_split(ckpt, "auto", group=group,
                               prefetch=planning_depth(prefetch))
        check_lockstep(shard, resident)
        share = shard_model(model, group, mode=shard, split=split)
        resident = share.resident = rank_value(resident, share.rank, share.size)
    elif resident == "auto":
        resident = f"{max(0, auto_budget())}B"
    sources = source_map(model, metas)
    if not strict:
        sources = sources.restrict_to(model)
    if share is not None:  # only this rank's tensors (or slices) from here on
        sources, ckpt = share.restrict(model, sources, ckpt)
        if resident == "auto":
            resident = share.auto_resident(sources.direct, planning_depth(prefetch))
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
    if not lazy and not overlap:
        mx.eval(controller.in_memory(model))  # not the streamed units' stand-ins

    if share is not None:
        share.finish(model)
    if bundle is not None:
        bundle.finish(model)
    return _finish(model, config, path, tokenizer, tokenizer_config, None, return_config,
                   kernels)


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


def _finish(model, config, path: Path, tokenizer: bool, tokenizer_config, adapter_path,
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


__all__ = ["STRATEGIES", "has_tokenizer", "load_model", "stats"]
