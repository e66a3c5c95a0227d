"""Batteries and mains through `/sys/class/power_supply/*`: the policy's battery level and AC/battery state.

Each supply has `type` (Mains, Battery, USB, UPS, Wireless), and as it applies `online` (1 when a mains or USB
supply is plugged in), `status` (Charging, Discharging, Full, Not charging, Unknown) and `capacity` (percent).
`scope` = Device marks a peripheral's battery (a wireless mouse): it says nothing about this machine and is
left out. A Jetson dev kit usually has none of these: then there is no battery and it runs on mains.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgekit.energy.sysfs import matching, optional_int, optional_text

SUPPLY_GLOB = "/sys/class/power_supply/*"


@dataclass(frozen=True)
class PowerSupply:
    name: str
    type: str
    online: bool | None
    status: str | None
    capacity_pct: float | None
    scope: str | None = None
    energy_now_j: float | None = None  # energy_now is µWh
    energy_full_j: float | None = None

    @property
    def is_system_battery(self) -> bool:
        return self.type == "Battery" and (self.scope or "System") != "Device"


@dataclass(frozen=True)
class BatteryState:
    """`percent`: the system batteries' charge (energy-weighted where they say their energy), None without one;
    `on_battery`: True when a system battery discharges or no mains/USB supply is online while one exists."""

    percent: float | None
    on_battery: bool
    batteries: tuple[str, ...] = ()


def _uwh_to_j(value: int | None) -> float | None:
    return value * 3.6e-3 if value is not None else None


def read_supplies(root: str | Path = "/") -> list[PowerSupply]:
    out = []
    for d in matching(root, SUPPLY_GLOB):
        online = optional_int(d / "online")
        out.append(
            PowerSupply(
                name=d.name,
                type=optional_text(d / "type") or "Unknown",
                online=bool(online) if online is not None else None,
                status=optional_text(d / "status"),
                capacity_pct=optional_int(d / "capacity"),
                scope=optional_text(d / "scope"),
                energy_now_j=_uwh_to_j(optional_int(d / "energy_now")),
                energy_full_j=_uwh_to_j(optional_int(d / "energy_full")),
            )
        )
    return out


def battery_state(root: str | Path = "/", supplies: list[PowerSupply] | None = None) -> BatteryState:
    supplies = read_supplies(root) if supplies is None else supplies
    bats = [s for s in supplies if s.is_system_battery]
    if not bats:
        return BatteryState(None, False)
    now = [b.energy_now_j for b in bats if b.energy_now_j is not None]
    full = [b.energy_full_j for b in bats if b.energy_full_j]
    percent: float | None
    if len(now) == len(full) == len(bats):
        percent = 100 * sum(now) / sum(full)
    else:
        known = [b.capacity_pct for b in bats if b.capacity_pct is not None]
        percent = sum(known) / len(known) if known else None
    external = [s for s in supplies if s.type in ("Mains", "USB", "UPS", "Wireless") and s.online is not None]
    discharging = any(b.status == "Discharging" for b in bats)
    on_battery = discharging or (bool(external) and not any(s.online for s in external))
    return BatteryState(percent, on_battery, tuple(b.name for b in bats))
