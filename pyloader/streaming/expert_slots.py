"""The expert caches' bookkeeping, without MLX: which expert sits in which slot,
decided round by round by a cache policy (:class:`LRU`, :class:`LFU`). The live caches and
:func:`simulate` run the same deterministic :class:`ExpertSlots`, so a replayed
:class:`RoutingTrace` counts exactly the live run's hits."""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Iterator, Sequence

import numpy as np


@dataclass
class Round:
    """What serving one round of experts takes: ``hits`` were in the cache, ``moves`` are
    the ``(expert, slot)`` reads for the others, ``evicted`` the experts they replaced."""

    hits: int = 0
    moves: list[tuple[int, int]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)


class CachePolicy(ABC):
    """Which experts a bank of ``capacity`` slots holds, and which one leaves on a
    miss. Experts of one round are never evicted for each other."""

    name: ClassVar[str]

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.slot_of: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.clock = 0

    def assign(self, experts: Sequence[int]) -> "Round":
        """The slots of one round's sorted distinct ``experts`` (at most the capacity)."""
        if len(experts) > self.capacity:
            raise ValueError(f"{len(experts)} experts in one round, {self.capacity} slots")
        self.clock += 1
        wanted = set(experts)
        r = Round()
        for e in experts:
            if e in self.slot_of:
                r.hits += 1
            else:
                if self._free:
                    slot = self._free.pop()
                else:
                    victim = self._victim(wanted)
                    slot = self.slot_of.pop(victim)
                    self._forget(victim)
                    r.evicted.append(victim)
                self.slot_of[e] = slot
                r.moves.append((e, slot))
            self._touch(e)
        return r

    @abstractmethod
    def _touch(self, expert: int) -> None:
        """Record a use of ``expert`` at :attr:`clock`."""

    @abstractmethod
    def _victim(self, protected: set[int]) -> int:
        """The cached expert (not in ``protected``) to evict."""

    @abstractmethod
    def _forget(self, expert: int) -> None:
        """``expert`` left the cache."""


class LRU(CachePolicy):
    """Evicts the least recently used expert."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()

    def _touch(self, expert):
        self._order[expert] = None
        self._order.move_to_end(expert)

    def _victim(self, protected):
        return next(e for e in self._order if e not in protected)

    def _forget(self, expert):
        del self._order[expert]


class LFU(CachePolicy):
    """Evicts the least frequently used expert (counted over the whole run); ties: LRU."""

    name = "lfu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.count: dict[int, int] = {}
        self._last: dict[int, int] = {}

    def _touch(self, expert):
        self.count[expert] = self.count.get(expert, 0) + 1
        self._last[expert] = self.clock

    def _victim(self, protected):
        return min((e for e in self.slot_of if e not in protected),
                   key=lambda e: (self.count[e], self._last[e]))

    def _forget(self, expert):
        pass


#: Cache policies by name (``StreamOptions(expert_policy=...)``).
POLICIES: dict[str, type[CachePolicy]] = {p.name: p for p in (LRU, LFU)}


@dataclass
class ExpertStats:
    """Counters of one expert cache."""

    calls: int = 0          # calls of the MoE module
    rounds: int = 0         # rounds (more than one when a call needed more experts than slots)
    routed: int = 0         # distinct experts routed to, summed over rounds
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    reads: int = 0          # positional reads issued (after merging)
    stall_s: float = 0.0    # time the forward pass waited for missing experts


class ExpertSlots:
    """Which expert is in which slot of one cache, decided by its policy, round by
    round. Deterministic."""

    def __init__(self, num_experts: int, capacity: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"unknown expert policy {policy!r}; expected one of "
                             f"{tuple(POLICIES)}")
        self.num_experts = num_experts
        self.capacity = capacity
        self.policy = POLICIES[policy](capacity)
        self.stats = ExpertStats()

    def rounds(self, experts: np.ndarray) -> Iterator[tuple[np.ndarray, Round]]:
        """Each round's experts for one call routing to sorted distinct
        ``experts``, and what serving it takes (counted in :attr:`stats`)."""
        st = self.stats
        st.calls += 1
        for start in range(0, len(experts), self.capacity):
            group = experts[start:start + self.capacity]
            r = self.policy.assign([int(e) for e in group])
            st.rounds += 1
            st.routed += len(group)
            st.hits += r.hits
            st.misses += len(r.moves)
            st.evictions += len(r.evicted)
            yield group, r

    def table(self, scratch: int) -> np.ndarray:
        """Expert id → slot id of every cached expert; ``scratch`` for the others."""
        t = np.full(self.num_experts, scratch, dtype=np.int64)
        for e, s in self.policy.slot_of.items():
            t[e] = s
        return t


def simulate(trace: "RoutingTrace", capacity: int, policy: str = "lru") -> dict[str, dict]:
    """Per layer and total counters a live run with ``capacity`` slots per layer would
    count on ``trace``."""
    out = {}
    for name, calls in trace.layers.items():
        slots = ExpertSlots(trace.num_experts[name], capacity, policy)
        for experts in calls:
            for _ in slots.rounds(np.asarray(experts, dtype=np.int64)):
                pass
        out[name] = asdict(slots.stats)
    out["total"] = totals(out.values())
    return out


#: The counters a routing decides (the simulator counts exactly these).
COUNTERS = ("calls", "rounds", "routed", "hits", "misses", "evictions")


def hit_rate(counters: dict) -> float:
    """Hits over routed experts (1.0 before any routing)."""
    return counters["hits"] / counters["routed"] if counters["routed"] else 1.0


def totals(rows, keys: Sequence[str] = COUNTERS) -> dict:
    """``keys`` summed over the per-cache counter dicts ``rows``, with the hit rate."""
    rows = list(rows)
    out = {k: sum(r[k] for r in rows) for k in keys}
    out["hit_rate"] = hit_rate(out)
    return out


@dataclass
class RoutingTrace:
    """The distinct experts each call of each MoE layer routed to, in order.

    Attributes:
        layers: MoE module path -> one sorted list of expert ids per call.
        num_experts: MoE module path -> its number of experts.
    """

    layers: dict[str, list[list[int]]] = field(default_factory=dict)
    num_experts: dict[str, int] = field(default_factory=dict)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as JSON."""
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RoutingTrace":
        """Read a trace written by :meth:`save`."""
        with open(path) as f:
            return cls(**json.load(f))
