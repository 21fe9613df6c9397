"""Per-rank reporting: the share, the reader's byte counters and the slices read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn

from .._native import core
from .._util.hooks import handle_of
from ..io.checkpoint import Checkpoint
from ..streaming import controller_of


def rank_stats(model: nn.Module) -> dict[str, Any]:
    """``pyloader.stats(model)`` plus this rank's share, the reader's byte counters and, when used,
    ``tensor_parallel`` and ``auto``."""
    h = handle_of(model)
    share = h.share if h is not None else None
    if share is None:
        raise ValueError("this model was not loaded by pyloader.load_model(group=...)")
    ctl = controller_of(model)
    st = ctl.stats()
    st.update(rank=share.rank, size=share.size, layers=[share.start, share.end],
              split=list(share.split), adapted_pipeline=share.adapted,
              owned_tensors=len(share.owned_tensors),
              owned_bytes=sum(ctl.checkpoint[n].nbytes for n in share.owned_tensors),
              mode=share.mode)
    if share.memory:  # resident="auto": what every rank measured, and this rank's budget
        st["auto"] = {"budget": share.resident.value,
                      "ranks": [{"rank": m.rank, "headroom": m.headroom, "budget": m.budget,
                                 "need": m.need} for m in share.memory]}
    if share.mode == "tensor":
        st["tensor_parallel"] = slice_stats(ctl.checkpoint, share.owned_tensors)
    return st


def slice_stats(ckpt: Checkpoint, names: Sequence[str]) -> dict[str, int]:
    """What reading ``names`` costs: ``whole_bytes``, ``sliced_bytes`` and, of those,
    ``strided_bytes`` read as ``strided_reads`` ranges over ``strided_page_bytes``."""
    page = core.page_size()  # the kernel's, or PYLOADER_PAGE_SIZE
    out = {"whole_bytes": 0, "sliced_bytes": 0, "strided_bytes": 0, "strided_reads": 0,
           "strided_page_bytes": 0}
    real = set(ckpt.keys())
    for n in names:
        t = ckpt[n]
        if n in real:
            out["whole_bytes"] += t.nbytes
            continue
        out["sliced_bytes"] += t.nbytes
        extents = ckpt.extents(n)
        if len(extents) > 1:
            out["strided_bytes"] += t.nbytes
            out["strided_reads"] += len(extents)
            pages = set()
            for off, length in extents:
                pages.update(range(off // page, (off + length - 1) // page + 1))
            out["strided_page_bytes"] += len(pages) * page
    return out
