"""Thermal zones through `/sys/class/thermal/thermal_zone*`: how close the machine is to throttling.

Each zone has `type` (`cpu-thermal`, `gpu-thermal`, `tj-thermal` on Jetson; `x86_pkg_temp`, `acpitz` on a PC),
`temp` in millidegrees Celsius and trip points `trip_point_<i>_temp` / `trip_point_<i>_type` (`active`: a fan
step; `passive`: the kernel throttles clocks; `hot`; `critical`: shutdown). The policy's signal is the headroom:
the smallest (lowest limiting trip - temperature) over all zones. `active` trips are fan steps, not limits, and
are left out; a trip at or below 0 °C is a disabled one (x86_pkg_temp ships two). A zone whose sensor is off
reads an error or -256 °C (Jetson's powered-down GPU): it has no temperature, not a very cold one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from edgekit.energy.sysfs import matching, optional_int, optional_text

ZONE_GLOB = "/sys/class/thermal/thermal_zone*"
LIMIT_TYPES = ("passive", "hot", "critical")
ABSENT_BELOW_C = -200.0


@dataclass(frozen=True)
class TripPoint:
    index: int
    temp_c: float
    type: str


@dataclass(frozen=True)
class ThermalZone:
    name: str  # thermal_zoneN
    type: str
    temp_c: float | None
    trips: tuple[TripPoint, ...] = ()

    def limit_c(self, types: tuple[str, ...] = LIMIT_TYPES) -> float | None:
        """The lowest enabled trip point of these types."""
        temps = [t.temp_c for t in self.trips if t.type in types and t.temp_c > 0]
        return min(temps) if temps else None

    def headroom_c(self, types: tuple[str, ...] = LIMIT_TYPES) -> float | None:
        limit = self.limit_c(types)
        return limit - self.temp_c if limit is not None and self.temp_c is not None else None


def read_zones(root: str | Path = "/") -> list[ThermalZone]:
    out = []
    for d in sorted(matching(root, ZONE_GLOB), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
        milli = optional_int(d / "temp")
        temp = milli / 1e3 if milli is not None and milli / 1e3 > ABSENT_BELOW_C else None
        trips = []
        for f in d.glob("trip_point_*_temp"):
            i = int(f.name.split("_")[2])
            t = optional_int(f)
            if t is not None:
                trips.append(TripPoint(i, t / 1e3, optional_text(d / f"trip_point_{i}_type") or "unknown"))
        trips.sort(key=lambda t: t.index)
        out.append(ThermalZone(d.name, optional_text(d / "type") or d.name, temp, tuple(trips)))
    return out


def headroom_c(zones: list[ThermalZone], types: tuple[str, ...] = LIMIT_TYPES) -> tuple[float, ThermalZone] | None:
    """The smallest headroom over the zones and the zone that has it; None when no zone has both a temperature
    and a limiting trip point."""
    rooms = [(h, z) for z in zones if (h := z.headroom_c(types)) is not None]
    return min(rooms, key=lambda hz: hz[0]) if rooms else None
