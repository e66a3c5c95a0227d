"""The canary window's arithmetic: a bundle's figures over its window, what its energy is judged against, and the
first threshold it breaks.

Why apart from `rollout`: these are the judgement, pure over figures and settings (tested without a daemon);
`rollout.Rollout` owns the steps, the slots and the lock, and asks here whether a window holds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .config import RolloutSettings

BASELINE = 50  # reports of the live bundle its canary successor is compared with


@dataclass
class Figures:
    """Reports and deliveries of one bundle over a window: what the canary is judged on."""

    reports: int = 0
    errors: int = 0
    latency_ms: deque = field(default_factory=lambda: deque(maxlen=BASELINE))
    energy_j: deque = field(default_factory=lambda: deque(maxlen=BASELINE))
    delivered: int = 0
    dead: int = 0
    started: float = field(default_factory=time.time)  # the canary window's start (a baseline's: when it began)
    energy_sources: set[str] = field(default_factory=set)  # the meters that billed its reports
    digest: str | None = None  # the bundle whose reports these are (None: not known yet)

    def p95(self) -> float | None:
        values = sorted(self.latency_ms)
        return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)] if values else None

    def mean_energy(self) -> float | None:
        return sum(self.energy_j) / len(self.energy_j) if self.energy_j else None

    def summary(self) -> dict[str, Any]:
        return {
            "reports": self.reports,
            "errors": self.errors,
            "p95_ms": self.p95(),
            "energy_j_per_report": self.mean_energy(),
            "delivered": self.delivered,
            "dead_letters": self.dead,
        }


PROFILE, PREVIOUS = "profile", "previous_bundle"


@dataclass(frozen=True)
class EnergyBaseline:
    """What a canary window's energy per report is judged against, chosen at the switch: the profile's figure for
    the new bundle (its `edgekit pareto` point with the variant's load-time settings; of several, the costliest,
    since the policy may serve any of them), or else the previous bundle's mean measured on this device."""

    kind: str  # PROFILE | PREVIOUS
    energy_j: float | None  # per report: the profile point's; the previous bundle's mean at the switch
    energy_source: str | None = None  # the profile point's meter (measured:<sensor>, emulated:x1, estimated:...)
    detail: str = ""  # which profile and point, or why no profile figure was used

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        figure = "no figure yet" if self.energy_j is None else f"{self.energy_j:.3g} J/report"
        source = f", {self.energy_source}" if self.energy_source else ""
        return f"{self.kind}: {figure} ({self.detail}{source})"

    def against(self, window: Figures, baseline: Figures) -> tuple[float | None, str]:
        """The figure the window is compared with now, and its name. A profile figure measured by another meter
        than the window's reports is not the same quantity: the previous bundle's measured figure then."""
        if self.kind == PROFILE and (not window.energy_sources or window.energy_sources <= {self.energy_source}):
            return self.energy_j, f"the profile's ({self.energy_source})"
        return baseline.mean_energy(), "the previous bundle's measured"


def breach(
    window: Figures, baseline: Figures, s: RolloutSettings, final: bool = False, energy: EnergyBaseline | None = None
) -> str | None:
    """The first threshold the canary window breaks, as a reason; None while it holds. Each is judged from
    `min_reports` reports (or settled deliveries) on, or at the window's end; latency against the previous
    bundle's own recent figures, energy against `energy` (None: the previous bundle's measured figure)."""
    if window.reports >= s.min_reports or (final and window.reports):
        if window.errors / window.reports > s.max_error_rate:
            return f"error rate {window.errors}/{window.reports} above {s.max_error_rate:.0%}"
        new, old = window.p95(), baseline.p95()
        if new is not None and old and new > s.max_p95_ratio * old:
            return f"p95 latency {new:.0f} ms above {s.max_p95_ratio}x the previous bundle's {old:.0f} ms"
        new_e = window.mean_energy()
        old_e, name = (energy or EnergyBaseline(PREVIOUS, None)).against(window, baseline)
        if new_e is not None and old_e and new_e > s.max_energy_ratio * old_e:
            return f"energy {new_e:.3g} J/report above {s.max_energy_ratio}x {name} {old_e:.3g} J"
    settled = window.delivered + window.dead
    if (settled >= s.min_reports or (final and settled)) and window.delivered / settled < s.min_delivery_rate:
        return f"SR delivery rate {window.delivered}/{settled} below {s.min_delivery_rate:.0%}"
    return None
