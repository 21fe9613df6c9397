"""``load_model``: the one way pyloader turns a model directory into an mlx-lm model.

Every load takes the same steps, for a plain checkpoint, a head bundle or one rank of a
distributed group::

    lazy skeleton        mlx-lm builds the model from config.json (its arrays never read)
    [shard]              group=: mlx-lm's pipeline sharding (pyloader.distributed)
    source map           which checkpoint tensor each parameter comes from
                         (pyloader.streaming.sources)
    [restrict]           group=: only this rank's tensors; bundle: the head's arrays
                         are read and verified apart from the trunk
    attach               the streaming controller loads the resident set and hooks
                         the streamed units (pyloader.streaming)
    [finish]             group=: the ranks synchronize; bundle: swap_head & co.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import mlx.nn as nn

from .distributed import rank_value, shard_model
from .heads import BundleLoad, is_bundle
from .io.checkpoint import Checkpoint
from .streaming import GRANULARITIES, StreamingController, source_map, stats
from .streaming.experts import POLICIES

STRATEGIES = ("mmap", "pread")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    """The model directory has tokenizer files."""
    return any((Path(path) / f).exists() for f in _TOKENIZER_FILES)


def load_model(
    path: str | os.PathLike[str],
    *,
    strategy: str = "mmap",
    resident: int | float | str = 1.0,
    placement: str = "first_n",
    granularity: str = "layer",
    prefetch: int = 1,
    keep_page_cache: bool = False,
    read_backend: str = "threads",
    tokenizer: bool = True,
    group=None,
    shard: str = "pipeline",
    split=None,
    head: Optional[str] = None,
    experts: Any = "layer",
    expert_policy: str = "lru",
    expert_source: str = "bank",
) -> tuple[nn.Module, Any]:
    """Load an mlx-lm model with a resident set and the rest streamed from disk.

    Args:
        path: mlx-lm model directory (``config.json`` + safetensors), or a head
            bundle (``pyloader heads build``).
        strategy: ``"mmap"`` or ``"pread"``: where streamed (and resident) weights come from.
        resident: Layers kept in memory: a count (int), a fraction (float in
            [0, 1]), a byte budget for all weights (str, e.g. ``"600MB"``) or
            a set of layer indices (e.g. ``pyloader.residency.plan(...).resident_layers``).
            Non-layer weights (embeddings, final norm, lm_head) are always resident.
        placement: Which layers are resident: ``"first_n"``, ``"last_n"`` or
            ``"interleaved"`` (spread evenly).
        granularity: ``"layer"`` streams whole layers; ``"sublayer"`` streams each
            layer's attention and MLP blocks separately (small norms stay resident).
        prefetch: How many streamed units ahead to bring in while the current one
            computes (0 disables prefetching).
        keep_page_cache: Keep released units in the page cache (drop them from this
            process only).
        read_backend: pread only: ``"threads"`` or ``"io_uring"``.
        tokenizer: Load the tokenizer too, when the checkpoint has one.
        group: An ``mx.distributed.Group``: apply mlx-lm's pipeline sharding
            and load/stream only this rank's layers (``resident`` may then be
            a list with one value per rank). See :mod:`pyloader.distributed`.
        shard: With ``group``: ``"pipeline"``.
        split: With ``group``: layers per rank (rank 0 runs the last layers),
            a ``distributed.SplitPlan``, or None for mlx-lm's even split.
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

    Returns:
        ``(model, tokenizer)``; ``tokenizer`` is None when the checkpoint has no
        tokenizer files. ``pyloader.stats(model)`` reports streaming counters.
    """
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected 'mmap' or 'pread'")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if expert_policy not in POLICIES:
        raise ValueError(f"unknown expert_policy {expert_policy!r}; expected one of "
                         f"{tuple(POLICIES)}")
    t0 = time.perf_counter()
    path = Path(path)
    bundle = None
    if head is not None or is_bundle(path):
        if group is not None:
            raise ValueError(f"{path}: a head bundle cannot be loaded with group= "
                             "(distributed loading takes a plain checkpoint)")
        if resident != 1.0:
            raise ValueError("head bundles load fully resident (resident=1.0)")
        bundle = BundleLoad(path, head)

    # The lazy skeleton: the model's structure (config, quantization) from mlx-lm
    # itself; its lazy mx.load arrays are never evaluated and are replaced below. A
    # repacked checkpoint's padding entries are not parameters: mlx-lm skips them here
    # (strict=False) and the controller's strict load_weights checks everything else.
    if bundle is not None:
        ckpt, model, metas = bundle.checkpoint, bundle.skeleton(), bundle.tensors()
    else:
        ckpt = Checkpoint(path)
        model, _ = mlx_lm_load_model(path, lazy=True, strict=not ckpt.padding_names)
        metas = ckpt.tensors()
    share = None
    if group is not None:
        share = shard_model(model, group, mode=shard, split=split)
        resident = rank_value(resident, share.rank, share.size)
    sources = source_map(model, metas)
    if share is not None:  # only this rank's tensors from here on
        sources = share.restrict(model, sources)
    given = sources.compute_derived(model, ckpt)
    if bundle is not None:
        sources, head_arrays = bundle.take_head(sources)
        given.update(head_arrays)

    controller = StreamingController(ckpt, strategy=strategy, prefetch=prefetch,
                                     keep_page_cache=keep_page_cache,
                                     read_backend=read_backend, granularity=granularity,
                                     experts=experts, expert_policy=expert_policy,
                                     expert_source=expert_source)
    controller.attach(model, sources.direct, given, resident=resident, placement=placement,
                      started=t0)

    if share is not None:
        share.finish(model)
    if bundle is not None:
        bundle.finish(model)
    tok = load_tokenizer(path) if tokenizer and has_tokenizer(path) else None
    return model, tok


__all__ = ["STRATEGIES", "has_tokenizer", "load_model", "stats"]
