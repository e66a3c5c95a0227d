"""What a meter reads, and the one label that says where a figure comes from.

Every power or energy figure edgekit prints carries a source (house rule 8), in exactly one of three forms:
`measured:<sensor>` (a sensor on this machine: `measured:ina3221:VDD_IN`, `measured:rapl:package-0`),
`emulated:<model>` (a cost model standing in for hardware we do not have: `emulated:x1`) or `estimated:<model>`
(arithmetic on something else, such as CPU time: `estimated:cpu-time-ccf`). They rank in that order: a measured
figure beats an emulated one, which beats an estimate, and a figure mixed from two sources takes the weaker label.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

from edgekit.errors import EdgekitError

KINDS = ("measured", "emulated", "estimated")  # best first
_LABEL = re.compile(r"^(measured|emulated|estimated):[^\s:][^\s]*$")


def measured(sensor: str) -> str:
    return check_source(f"measured:{sensor}")


def emulated(model: str) -> str:
    return check_source(f"emulated:{model}")


def estimated(model: str) -> str:
    return check_source(f"estimated:{model}")


def check_source(label: object) -> str:
    """`label` if it is one of the three forms (no spaces, a non-empty name); ValueError otherwise."""
    if not isinstance(label, str) or not _LABEL.match(label):
        raise ValueError(f"an energy source is measured:<sensor>, emulated:<model> or estimated:<model>, not {label!r}")
    return label


def kind_of(label: str) -> str:
    return check_source(label).split(":", 1)[0]


def rank(label: str) -> int:
    """0 for measured, 1 emulated, 2 estimated: lower is better."""
    return KINDS.index(kind_of(label))


def weakest(labels: Iterable[str]) -> str:
    """The label a figure mixed from these sources must carry (the last of the weakest kind)."""
    labels = list(labels)
    worst = max(rank(s) for s in labels)
    return [s for s in labels if rank(s) == worst][-1]


class MeterUnavailableError(EdgekitError):
    """A meter that cannot be opened here: no sensor, a file the user may not read, a missing library. `path`
    names the file (or library) and `reason` says what to do about it."""

    code = "meter_unavailable"


class MeterReadError(Exception):
    """A meter that was working and stopped: a file gone, garbage read, a counter that ran backwards. The sampler
    catches it and falls back to the next meter."""


@dataclass(frozen=True)
class PowerReading:
    """One reading. `watts` is the source's total now (None for a counter's first reading, which has no interval
    yet); `rails` the parts it was read from (W by rail name); `energy_j` a counter meter's cumulative joules
    since it was opened (unwrapped), None for meters that only read power; `t` is `time.monotonic()`."""

    watts: float | None
    source: str
    t: float
    rails: Mapping[str, float] = field(default_factory=dict)
    energy_j: float | None = None

    def problem(self, max_watts: float) -> str | None:
        """Why this reading is garbage (non-finite, negative, beyond `max_watts`), or None."""
        for name, w in [("total", self.watts), *self.rails.items()]:
            if w is None and name == "total":
                continue
            if not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0 or w > max_watts:
                return f"{name} power {w!r} W is not a number in [0, {max_watts:g}]"
        if self.energy_j is not None and not (isinstance(self.energy_j, (int, float)) and math.isfinite(self.energy_j)):
            return f"energy counter {self.energy_j!r} is not a number"
        return None


@dataclass(frozen=True)
class EnergyReading:
    """The energy of one window (one report): joules over seconds, from `source`. `fell_back_from` lists the
    sources that failed during it (then `source` is the weakest label of those that contributed); `samples` counts
    the readings integrated (2 or more)."""

    joules: float
    seconds: float
    source: str
    samples: int = 2
    fell_back_from: tuple[str, ...] = ()

    @property
    def mean_watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "fell_back_from": list(self.fell_back_from), "mean_watts": self.mean_watts}


@runtime_checkable
class Meter(Protocol):
    """A source of power readings. `read()` raises MeterReadError (or OSError/ValueError) when the source is gone
    or reads garbage; `describe()` is what pareto.json records about it."""

    source: str

    def read(self) -> PowerReading: ...

    def describe(self) -> dict: ...
