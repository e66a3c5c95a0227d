"""The machine's energy conditions in one read: power now, battery, AC, thermal headroom (the policy's inputs).

The daemon's policy ticks every few seconds; each tick needs the same handful of facts, read from the same root
its meters read. Power comes from a running sampler's last reading (no extra meter read); battery and thermal
from sysfs at the time of the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgekit.energy.power_supply import battery_state
from edgekit.energy.sampler import Sampler
from edgekit.energy.thermal import LIMIT_TYPES, headroom_c, read_zones


@dataclass(frozen=True)
class Conditions:
    power_w: float | None = None
    power_source: str | None = None
    battery_pct: float | None = None
    on_battery: bool = False
    thermal_headroom_c: float | None = None  # min over zones of (lowest limiting trip point - temperature)
    hottest_zone: str | None = None  # the zone with that headroom


def read_conditions(
    root: str | Path = "/", sampler: Sampler | None = None, trip_types: tuple[str, ...] = LIMIT_TYPES
) -> Conditions:
    latest = sampler.latest() if sampler is not None else None
    battery = battery_state(root)
    room = headroom_c(read_zones(root), trip_types)
    return Conditions(
        power_w=latest.watts if latest is not None else None,
        power_source=latest.source if latest is not None else None,
        battery_pct=battery.percent,
        on_battery=battery.on_battery,
        thermal_headroom_c=room[0] if room else None,
        hottest_zone=room[1].type if room else None,
    )
