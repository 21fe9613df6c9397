"""The memory-pressure monitor. See docs/memory-planning.md."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from .._util.hooks import add_hook, attach_handle, remove_hook
from .._util.memory import read_memory
from ..streaming import controller_of

#: Default water marks; "auto" plans keep the high water free, a shed restores it.
DEFAULT_LOW_WATER = 96 << 20
DEFAULT_HIGH_WATER = 192 << 20


def resident_layers(model) -> set[int]:
    """Indices of the layers a model from :func:`pyloader.load_model` keeps resident."""
    return set(controller_of(model).layout.resident)


def shed_layers(model, layers: Sequence[int]) -> int:
    """Turn resident layers into streamed ones; returns the weight bytes released."""
    return controller_of(model).shed(layers)


def admit_layers(model, layers: Sequence[int]) -> int:
    """Turn streamed layers back into resident ones; returns the bytes loaded."""
    return controller_of(model).admit(layers)


@dataclass
class PressureEvent:
    """One decision of the pressure monitor: layers shed or re-admitted."""

    call: int           # forward calls seen when it happened
    action: str         # "shed" or "admit"
    layers: tuple[int, ...]
    headroom: int       # the window's reading that decided it
    nbytes: int
    time: float


def under_pressure(sample, psi_threshold: float) -> bool:
    """Whether a snapshot shows pressure (PSI at ``psi_threshold``, or the kernel level)."""
    psi = getattr(sample, "psi_some_avg10", None)
    if psi is not None:
        return psi >= psi_threshold
    return getattr(sample, "pressure_level", None) in ("warning", "critical")


@dataclass(frozen=True)
class PressureSettings:
    """When :class:`PressureMonitor` reads the probe and how it acts.

    Attributes:
        low_water, high_water: Headroom (bytes) that triggers a shed / permits a re-admit.
        every, window: Forward calls between readings; readings per decision (>= 2).
        cooldown: Calls after a change before a layer is re-admitted.
        psi_threshold: PSI ``some avg10`` percent counting as pressure (None: headroom only).
        readmit, min_resident: Whether to re-admit; layers never shed.
    """

    low_water: int = DEFAULT_LOW_WATER
    high_water: int = DEFAULT_HIGH_WATER
    every: int = 1
    window: int = 3
    cooldown: int = 8
    psi_threshold: float | None = None
    readmit: bool = True
    min_resident: int = 0

    def __post_init__(self) -> None:
        if self.high_water <= self.low_water:
            raise ValueError(f"high_water ({self.high_water}) must be above low_water "
                             f"({self.low_water})")
        if self.window < 2:
            raise ValueError("window must be at least 2: a single reading never decides")
        if self.every < 1:
            raise ValueError("every must be >= 1")


class PressureMonitor:
    """Watches headroom while a model runs and sheds / re-admits resident layers.

    Decides on the last ``window`` readings, never one: sheds the highest resident layers
    below ``low_water``, re-admits the lowest streamed layer above ``high_water`` plus its
    bytes; hysteresis keeps an admit from triggering a shed.
    """

    def __init__(self, model, settings: PressureSettings | None = None, *,
                 probe: Callable[[], Any] | None = None):
        settings = settings if settings is not None else PressureSettings()
        self.model = model
        self.ctl = controller_of(model)
        self.probe = read_memory if probe is None else probe
        self.settings = settings
        self.samples: deque = deque(maxlen=settings.window)
        self.calls = 0
        self.last_change = -(10**9)
        self._shed_floor: int | None = None  # best reading of the first window after a shed
        self.events: list[PressureEvent] = []
        self._attached = False

    def attach(self) -> "PressureMonitor":
        """Makes every forward call of the model tick the monitor first."""
        if self._attached:
            return self
        add_hook(self.model, "monitor", self._hook)
        attach_handle(self.model).monitor = self
        self._attached = True
        return self

    def _hook(self, model, call, *args, **kwargs):
        self.tick()
        return call(*args, **kwargs)

    def detach(self) -> None:
        """Stop watching: the model's forward calls no longer tick the monitor."""
        if self._attached:
            remove_hook(self.model, "monitor")
            attach_handle(self.model).monitor = None
            self._attached = False

    def _reading(self) -> int | None:
        sample, s = self.probe(), self.settings
        h = sample if sample is None or isinstance(sample, int) else sample.headroom
        if (h is not None and s.psi_threshold is not None and not isinstance(sample, int)
                and under_pressure(sample, s.psi_threshold)):
            h = min(h, s.low_water - 1)
        return h

    def _unit_bytes(self) -> int:
        lb = self.ctl.layout.layer_bytes
        return max(lb) if lb else 0

    def _transient(self, streaming: bool) -> int:
        """Streaming memory a reading at the start of a forward call does not see."""
        u = self._unit_bytes()
        return u if streaming else (self.ctl.depth + 1) * u

    def tick(self) -> PressureEvent | None:
        """One forward call; reads the probe every ``every`` calls and acts if needed."""
        s = self.settings
        self.calls += 1
        if self.calls % s.every:
            return None
        h = self._reading()
        if h is None:
            return None
        self.samples.append(h)
        if len(self.samples) < s.window:
            return None
        if self._shed_floor is None and self.events and self.events[-1].action == "shed":
            self._shed_floor = max(self.samples)
        lay = self.ctl.layout
        lb = lay.layer_bytes
        n = len(lb)
        best, worst = max(self.samples), min(self.samples)
        resident = sorted(lay.resident)
        streaming = len(resident) < n
        if best < s.low_water and len(resident) > s.min_resident:
            need = s.high_water + self._transient(streaming) - best
            shed, freed = [], 0
            for i in reversed(resident[s.min_resident:]):
                if freed >= need:
                    break
                shed.append(i)
                freed += lb[i]
            return self._apply("shed", shed, best)
        if s.readmit and streaming and self.calls - self.last_change >= s.cooldown:
            streamed = [i for i in range(n) if i not in lay.resident]
            j = streamed[0]
            if len(streamed) == 1:  # streaming stops: its buffers are given back
                need = lb[j] - self.ctl.depth * self._unit_bytes()
            else:
                need = lb[j] + self._transient(True)
            grown = (self._shed_floor is None
                     or worst > self._shed_floor + s.high_water - s.low_water)
            if worst >= s.high_water + max(need, 0) and grown:
                return self._apply("admit", [j], worst)
        return None

    def _apply(self, action: str, layers: list[int], headroom: int) -> PressureEvent:
        nbytes = (shed_layers if action == "shed" else admit_layers)(self.model, layers)
        ev = PressureEvent(self.calls, action, tuple(sorted(layers)), headroom, nbytes,
                           time.monotonic())
        self.events.append(ev)
        self.samples.clear()
        self.last_change = self.calls
        self._shed_floor = None
        return ev

    def stats(self) -> dict:
        return {"calls": self.calls, "resident_layers": sorted(self.ctl.layout.resident),
                "events": [asdict(e) for e in self.events]}
