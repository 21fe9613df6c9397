"""The expert caches of an attached model: one cache per mixture-of-experts module
(:mod:`.experts`), their counters and routing trace. None with ``experts="layer"``."""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .._native import core
from .._util.hooks import add_hook
from ..io.checkpoint import Checkpoint
from ..io.readers import MmapReader
from .expert_slots import COUNTERS, totals
from .experts import (
    HOOK,
    LAYER,
    BankExperts,
    ExpertCache,
    MappedExperts,
    MoeModule,
    cache_memory,
    cache_slots,
    expert_modules,
    routing_trace,
)
from .options import StreamOptions
from .reads import UnitReads
from .units import LayerEntry


class ExpertCaches:
    """The expert caches of one controller, as ``options`` (``experts``,
    ``expert_policy``, ``expert_source``) set them; mapped caches share the mmap reader of
    ``reads``."""

    def __init__(self, ckpt: Checkpoint, options: StreamOptions, reads: UnitReads,
                 lock: threading.RLock):
        self.checkpoint = ckpt
        self.setting = options.experts
        self.policy = options.expert_policy
        self.source = options.expert_source
        self.lock = lock
        self.reader = None
        if options.caches_experts:
            self.reader = (
                core.ExpertReader(ckpt.index, backend=options.read_backend,
                                  drop_cache=not options.keep_page_cache)
                if options.expert_source == "bank" else
                reads.reader if isinstance(reads.reader, MmapReader) else MmapReader(ckpt))
        self.found: list[MoeModule] = []
        self.caches: list[ExpertCache] = []

    @property
    def enabled(self) -> bool:
        """Experts are cached (``experts`` is not ``"layer"``)."""
        return self.setting != LAYER

    def find(self, layers: list[LayerEntry], derived: dict[str, mx.array]) -> None:
        """Find every MoE module of ``layers`` (taking their stacked tensors from the
        layers' sources) and size each cache; ValueError for an expert tensor not stacked
        in the checkpoint, or no MoE module."""
        found = []
        for layer in layers:
            for path, module in expert_modules(layer.module, layer.path):
                sources = layer.sources_under(path)
                params = {p for p, _ in tree_flatten(module.parameters())}
                missing = sorted(params - set(sources))
                if missing:
                    why = ("computed by the model's sanitize (experts stored one tensor each: "
                           "convert the checkpoint with mlx_lm.convert, which stacks them)"
                           if any(f"{path}.{p}" in derived for p in missing)
                           else "not in the checkpoint")
                    raise ValueError(f"{path}: parameters {missing[:3]} are {why}; expert "
                                     "streaming needs every expert tensor stacked [E, ...]")
                for p in sources:
                    del layer.sources[f"{path}.{p}"]
                strides = [t.nbytes // t.shape[0] for t in sources.values()]
                found.append(MoeModule(path, module, layer.index, sources, strides))
        if not found:
            raise ValueError(f"experts={self.setting!r}: the model has no mixture-of-experts "
                             "modules (mlx-lm's SwitchGLU / SwitchMLP); use experts='layer'")
        slots = cache_slots(self.setting, [(m.num_experts, m.strides) for m in found],
                            self.source)
        for m, n in zip(found, slots):
            m.slots = n
        self.found = found

    @property
    def params(self) -> set[str]:
        """Full paths of the parameters the caches own."""
        return {f"{m.path}.{p}" for m in self.found for p in m.sources}

    @property
    def bank_bytes(self) -> int:
        """Memory the caches' banks will take (``expert_source="bank"``; 0 otherwise)."""
        if self.source != "bank":
            return 0
        return sum(cache_memory("bank", m.strides, m.slots) for m in self.found)

    def build(self, keep_page_cache: bool) -> list[ExpertCache]:
        """One cache per MoE module found."""
        caches = [BankExperts(m, self.policy, self.checkpoint, self.reader)
                  if self.source == "bank" else
                  MappedExperts(m, self.policy, self.reader, keep_page_cache) for m in self.found]
        for c in caches:
            c.lock = self.lock
        self.caches = caches
        return caches

    def place(self) -> None:
        """Put the caches' arrays in their modules, replacing the full-shape stand-ins."""
        for c in self.caches:
            c.module.update(tree_unflatten(list(c.arrays().items())))

    def install(self) -> None:
        """Serve the routed experts: read all-fitting caches once, hook the others."""
        for c in self.caches:
            if c.resident:
                c.load_all()
            else:
                add_hook(c.module, HOOK, c)

    def routing_trace(self):
        """Context manager recording every cache's routing."""
        return routing_trace(self.caches)

    def stats(self) -> dict:
        """Per cache and total counters."""
        per = {c.name: c.stats() for c in self.caches}
        total = totals(per.values(), COUNTERS + ("bytes_read", "reads", "stall_s", "bank_bytes"))
        return {"policy": self.policy, "setting": self.setting, "source": self.source,
                "layers": per, "total": total}
