"""The energy-quality policy: which profiled point edgekitd serves now, and why.

Pure decisions: the points come from a Pareto profile (`edgekit pareto`), the signals from the meters, the clock
is passed in, so tests and the bench drive it tick by tick. What the service does with a decision (load the next
variant beside the current one, move the active name) lives in `service.py`.

How a point is chosen: the configured constraints, tightened by the signals (a battery running low on battery
power turns the mode to `saver`, a thermal zone near its trip point too and one past it asks for the coolest
point, measured power over the budget or a queue the latency SLO cannot absorb ask for a cheaper or faster point
than the current one), pick the cheapest point (`saver`), the best (`performance`) or the cheapest within
`balanced_f1_slack` of the best (`balanced`) that meets every constraint. When none does, the best-quality point
within the power budget is served and the broken constraints are reported: service is never refused for this.
Quality is a point's lower F1 of its DICOM studies and its video clips (`Point.lowest_f1`), so a point that skips
video frames is never "as good" because its DICOM figure did not move.

Anti-flapping, as production autoscalers do it: a crossed limit steps down within the tick; a step up waits until
its condition has held for `window_s` (the Kubernetes HPA's 300 s stabilisation window) and its gain clears
`margin`; and no switch comes sooner than the current point's measured load time after the last one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from edgekit.errors import ConfigError
from edgekit.pareto import Point

MODES = ("performance", "balanced", "saver", "fixed")  # what a user sets; signals may also ask for "fast"


def best_quality(p: Point) -> tuple[float, float]:
    """The sort key of "the best point": the higher quality (`Point.lowest_f1`), then the less energy."""
    return (p.lowest_f1, -p.energy_j)


@dataclass(frozen=True)
class Constraints:
    power_budget_w: float | None = None  # average power while its reports run (`Point.power_w`)
    energy_budget_j: float | None = None  # per report
    quality_floor_f1: float | None = None  # finding F1 on the profiled split (its DICOM studies and video clips)
    latency_slo_ms: float | None = None  # p95 per report

    def broken_by(self, p: Point) -> list[str]:
        out = []
        if self.power_budget_w is not None and p.power_w > self.power_budget_w:
            out.append("power_budget_w")
        if self.energy_budget_j is not None and p.energy_j > self.energy_budget_j:
            out.append("energy_budget_j")
        if self.quality_floor_f1 is not None and p.lowest_f1 < self.quality_floor_f1:
            out.append("quality_floor_f1")
        if self.latency_slo_ms is not None and p.latency_p95_ms > self.latency_slo_ms:
            out.append("latency_slo_ms")
        return out


@dataclass(frozen=True)
class Signals:
    """What the meters and the queue say now; None where nothing measures it."""

    power_w: float | None = None  # measured board or package power
    power_source: str | None = None
    battery_pct: float | None = None
    on_battery: bool = False
    thermal_headroom_c: float | None = None  # min over zones of (lowest trip point - temperature)
    queue_depth: int = 0
    recent_p95_ms: float | None = None


@dataclass(frozen=True)
class PolicySettings:
    mode: str = "balanced"
    constraints: Constraints = field(default_factory=Constraints)
    fixed: str | None = None  # the point id (or variant name) served in `fixed` mode
    window_s: float = 300.0
    margin: float = 0.10
    balanced_f1_slack: float = 0.01
    battery_low_pct: float = 30.0
    thermal_margin_c: float = 5.0
    queue_high: int = 4
    allow_overrides: bool = True

    def check(self, where=None) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"policy mode must be one of {', '.join(MODES)}, got {self.mode!r}", where)
        if self.mode == "fixed" and not self.fixed:
            raise ConfigError("policy mode 'fixed' needs policy.fixed (a point id or variant name)", where)
        numbers = {
            "window_s": self.window_s,
            "margin": self.margin,
            "balanced_f1_slack": self.balanced_f1_slack,
            "battery_low_pct": self.battery_low_pct,
            "thermal_margin_c": self.thermal_margin_c,
            **{k: v for k, v in vars(self.constraints).items() if v is not None},
        }
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"policy {name} must be a finite number >= 0, got {value!r}", where)
        if self.queue_high < 1:
            raise ConfigError(f"policy queue_high must be >= 1, got {self.queue_high!r}", where)


@dataclass(frozen=True)
class Choice:
    point: Point
    reason: str  # why these constraints and mode: "constraints", "battery", "thermal", "power", "load", "fixed", ...
    mode: str  # the mode in force after the signals
    broken: tuple[str, ...] = ()  # constraints no point could meet


def effective(settings: PolicySettings, signals: Signals, current: Point | None) -> tuple[str, Constraints, str]:
    """The objective and constraints in force once the signals are read, and the signal that set them.

    Objectives: the configured mode, `saver` on a low battery or a hot zone, `fast` (the lowest p95 per report in
    flight that meets the constraints, `Point.drain_p95_ms`: a batched point clears a queue faster than its own
    p95 says) when the queue is deep or recent reports missed the latency SLO."""
    mode, c, reason = settings.mode, settings.constraints, "constraints"
    if signals.on_battery and signals.battery_pct is not None and signals.battery_pct < settings.battery_low_pct:
        mode, reason = "saver", "battery"
    if signals.thermal_headroom_c is not None and signals.thermal_headroom_c < settings.thermal_margin_c:
        mode, reason = "saver", "thermal"
        if signals.thermal_headroom_c <= 0 and current is not None:  # past a trip point: cooler than now, whatever
            c = replace(c, power_budget_w=min(c.power_budget_w or math.inf, current.power_w * 0.999))
    budget = settings.constraints.power_budget_w  # the configured budget: heat's tightening is not the board's
    if budget is not None and signals.power_w is not None and signals.power_w > budget and current is not None:
        # the board draws more than the budget: our share must shrink below the current point's
        c = replace(c, power_budget_w=min(c.power_budget_w or budget, current.power_w * 0.999))
        reason = "power" if reason == "constraints" else reason
    late = (
        signals.recent_p95_ms is not None and c.latency_slo_ms is not None and signals.recent_p95_ms > c.latency_slo_ms
    )
    if (signals.queue_depth >= settings.queue_high or late) and reason == "constraints":
        mode, reason = "fast", "load"
    return mode, c, reason


def choose(points: Sequence[Point], settings: PolicySettings, signals: Signals, current: Point | None) -> Choice:
    """The point the policy wants now, before anti-flapping."""
    if settings.mode == "fixed":
        return Choice(find(points, settings.fixed or ""), "fixed", "fixed")
    mode, c, reason = effective(settings, signals, current)
    fits = [p for p in points if not c.broken_by(p)]
    if fits:
        if mode == "performance":
            best = max(fits, key=best_quality)
        elif mode == "saver":
            best = min(fits, key=lambda p: (p.energy_j, -p.lowest_f1))
        elif mode == "fast":
            best = min(fits, key=lambda p: (p.drain_p95_ms, p.energy_j))
        else:
            top = max(p.lowest_f1 for p in fits)
            near = (p for p in fits if p.lowest_f1 >= top - settings.balanced_f1_slack)
            best = min(near, key=lambda p: (p.energy_j, -p.lowest_f1))
        return Choice(best, reason, mode)
    within_power = [p for p in points if "power_budget_w" not in c.broken_by(p)]
    if within_power:
        pick = max(within_power, key=best_quality)
    else:
        pick = min(points, key=lambda p: p.power_w)
    return Choice(pick, reason, mode, tuple(c.broken_by(pick)))


def find(points: Sequence[Point], name: str) -> Point:
    """A point by id, or the best point of a variant by its name (`settings['variant']`)."""
    for p in points:
        if p.id == name:
            return p
    named = [p for p in points if p.settings.get("variant") == name]
    if named:
        return max(named, key=best_quality)
    raise ConfigError(f"no profiled point or variant named {name!r} (points: {', '.join(p.id for p in points)})")


def gain(current: Point, new: Point, mode: str) -> float:
    """How much better `new` is than `current` by what `mode` optimises, as a fraction: the cut in F1 error
    (performance), in energy (saver), in p95 latency (fast), the larger of error and energy (balanced)."""
    error = ((1.0 - current.lowest_f1) - (1.0 - new.lowest_f1)) / max(1.0 - current.lowest_f1, 1e-6)
    energy = (current.energy_j - new.energy_j) / max(current.energy_j, 1e-12)
    latency = (current.latency_p95_ms - new.latency_p95_ms) / max(current.latency_p95_ms, 1e-12)
    return {"performance": error, "saver": energy, "fast": latency}.get(mode, max(error, energy))


def is_step_down(current: Point, want: Choice, limits: Constraints) -> bool:
    """A switch a signal or a crossed limit asks for now: the current point breaks a limit the new one meets, or a
    signal fired and the new point is cheaper (battery, heat, power) or faster (load)."""
    if len(limits.broken_by(want.point)) < len(limits.broken_by(current)):
        return True
    if want.reason == "load":
        return want.point.latency_p95_ms < current.latency_p95_ms
    if want.reason in ("battery", "thermal", "power"):
        return want.point.energy_j < current.energy_j
    return False


@dataclass(frozen=True)
class Decision:
    point: Point
    switched: bool
    reason: str
    previous: str | None = None
    broken: tuple[str, ...] = ()
    held_back: str | None = None  # a step up waiting for the window or the margin


class Governor:
    """Anti-flapping around `choose`: call `tick(now, signals)` once per policy tick."""

    def __init__(self, points: Sequence[Point], settings: PolicySettings):
        if not points:
            raise ConfigError("the policy needs at least one profiled point")
        self.points = list(points)
        self.settings = settings
        self.current: Point | None = None
        self.since = -math.inf  # when the current point started
        self._pending: tuple[str, float] | None = None  # (point id, since) of a step up waiting
        self.switches = 0
        self.last: Decision | None = None
        self._asked = False

    def configure(self, settings: PolicySettings) -> None:
        """New settings (PUT /v1/policy, a reload): what a person asked for is done at the next tick, with no
        window to wait for (the window guards against signals that flap, not against decisions)."""
        self.settings = settings
        self._pending = None
        self._asked = True

    def tick(self, now: float, signals: Signals) -> Decision:
        want = choose(self.points, self.settings, signals, self.current)
        cur = self.current
        asked, self._asked = self._asked, False
        if cur is None:
            return self._switch(now, want, "start")
        if asked and want.point.id != cur.id:
            return self._switch(now, want, "settings")
        if want.point.id == cur.id:
            self._pending = None
            return self._keep(want)
        if now - self.since < cur.load_ms / 1e3:
            return self._keep(want, held_back="load_time")
        _, limits, _ = effective(self.settings, signals, cur)
        if self.settings.mode == "fixed" or is_step_down(cur, want, limits):
            return self._switch(now, want, want.reason)
        if self._pending is None or self._pending[0] != want.point.id:
            self._pending = (want.point.id, now)
        if now - self._pending[1] < self.settings.window_s:
            return self._keep(want, held_back="window")
        if gain(cur, want.point, want.mode) < self.settings.margin:
            return self._keep(want, held_back="margin")
        return self._switch(now, want, f"{want.reason}:step_up")

    def _keep(self, want: Choice, held_back: str | None = None) -> Decision:
        assert self.current is not None
        broken = tuple(self.settings.constraints.broken_by(self.current)) if want.broken else ()
        self.last = Decision(self.current, False, want.reason, self.current.id, broken, held_back)
        return self.last

    def _switch(self, now: float, want: Choice, reason: str) -> Decision:
        previous = self.current.id if self.current else None
        self.current, self.since, self._pending = want.point, now, None
        self.switches += previous is not None
        self.last = Decision(want.point, previous is not None, reason, previous, want.broken)
        return self.last
