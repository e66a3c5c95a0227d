"""Energy a target's backend emulates per report (the X1 cost model: `emulated:x1`), read from its cost.

A backend that emulates its own device bills each report through `take_cost()` (`edgekit.generate.take_cost`):
a dict with `energy_j` and `figure_source` (a label of `edgekit.energy.reading`, e.g. `emulated:x1`); older
costs carry `mj_total` instead of `energy_j`. That energy is the device's, not the host's that runs the
emulator, so for such a target it replaces any host meter (a host sensor would measure the emulator). A target
that measures its own device (a `measured:` label) is read the same way. The core reads the dict; it never
imports a target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from edgekit.energy.reading import EnergyReading, MeterReadError, check_source


class CostBilling(Protocol):
    """A backend that bills each report (`edgekit.generate.Backend` plus `take_cost`)."""

    def take_cost(self) -> dict: ...


def energy_from_cost(cost: Mapping) -> EnergyReading | None:
    """The report's emulated energy, or None when the cost states none (a backend that measures nothing).
    MeterReadError when it states one that is not a finite, non-negative number with a valid label."""
    if "energy_j" in cost:
        joules = cost["energy_j"]
    elif "mj_total" in cost:
        joules = cost["mj_total"] / 1e3 if isinstance(cost["mj_total"], (int, float)) else cost["mj_total"]
    else:
        return None
    try:
        label = check_source(cost.get("figure_source"))
    except ValueError as e:
        raise MeterReadError(f"a cost with energy but no valid figure_source: {e}") from None
    if isinstance(joules, bool) or not isinstance(joules, (int, float)) or not math.isfinite(joules) or joules < 0:
        raise MeterReadError(f"{label}: energy {joules!r} J is not a finite non-negative number")
    seconds = cost.get("latency_ms", cost.get("emulated_ms_total", 0.0)) / 1e3
    return EnergyReading(float(joules), float(seconds), label, samples=1)
