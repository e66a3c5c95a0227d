"""The best meter this machine has, and a description of the machine and its meters (for pareto.json).

Order: a sensor (`measured:`) beats an emulation, which beats an estimate. Among sensors: the Jetson INA3221
(the whole module), then NVML (a discrete GPU's board), then RAPL (the CPU packages). Emulated energy is not a
host meter: a target whose backend emulates its device bills each report through its cost
(`edgekit.energy.emulated`), which wins over any meter here. The CPU-time estimate is always available and
always last, so a sampler built here never runs out of meters.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from pathlib import Path

from edgekit.energy.cpu_estimate import CCF_AWS, CpuModel, CpuTimeMeter
from edgekit.energy.ina3221 import Ina3221Meter
from edgekit.energy.nvml import NvmlMeter
from edgekit.energy.nvpmodel import power_mode
from edgekit.energy.power_supply import battery_state
from edgekit.energy.rapl import RaplMeter
from edgekit.energy.reading import Meter, MeterUnavailableError
from edgekit.energy.sampler import DEFAULT_INTERVAL_S, Sampler
from edgekit.energy.sysfs import optional_text, under
from edgekit.energy.thermal import headroom_c, read_zones
from edgekit.errors import ConfigError

SENSORS = ("ina3221", "nvml", "rapl")  # best first
METERS = (*SENSORS, "cpu-time")
MODEL_FILES = (  # the device tree's model on Jetson and other ARM boards, DMI's product name on a PC
    "/proc/device-tree/model",
    "/sys/firmware/devicetree/base/model",
    "/sys/devices/virtual/dmi/id/product_name",
)


def _open(name: str, root: str | Path, cpu_model: CpuModel) -> Meter:
    if name == "ina3221":
        return Ina3221Meter(root)
    if name == "nvml":
        if Path(root) != Path("/"):
            raise MeterUnavailableError("NVML reads the driver, not a directory tree: only on the real root", root)
        return NvmlMeter()
    if name == "rapl":
        return RaplMeter(root)
    if name == "cpu-time":
        return CpuTimeMeter(cpu_model)
    raise ConfigError(f"unknown energy meter {name!r} (known: auto, {', '.join(METERS)})")


def find_meters(root: str | Path = "/", cpu_model: CpuModel = CCF_AWS) -> tuple[list[Meter], list[dict]]:
    """Every meter that opens here, best first (the CPU-time estimate last), and why each other one did not."""
    meters, missing = [], []
    for name in METERS:
        try:
            meters.append(_open(name, root, cpu_model))
        except MeterUnavailableError as e:
            missing.append({"meter": name, "reason": str(e)})
    return meters, missing


def discover_meters(root: str | Path = "/", cpu_model: CpuModel = CCF_AWS) -> list[Meter]:
    """Every meter that opens here, best first: the fallback order for a `Sampler`. Never empty (the CPU-time
    estimate is always there)."""
    return find_meters(root, cpu_model)[0]


def open_meter(name: str = "auto", root: str | Path = "/", cpu_model: CpuModel = CCF_AWS) -> Meter:
    """One meter by name (`ina3221`, `nvml`, `rapl`, `cpu-time`), or the best one here (`auto`).
    MeterUnavailableError (one line naming the file and why) when the named one cannot open here."""
    if name == "auto":
        return find_meters(root, cpu_model)[0][0]
    return _open(name, root, cpu_model)


def open_sampler(
    name: str = "auto", root: str | Path = "/", interval_s: float = DEFAULT_INTERVAL_S, cpu_model=CCF_AWS
) -> Sampler:
    """A sampler (not started) on the named or best meter, falling back along every other meter that opens
    here, the CPU-time estimate last."""
    found, _ = find_meters(root, cpu_model)
    meters = found if name == "auto" else [open_meter(name, root, cpu_model)]
    meters += [m for m in found if m.source not in {x.source for x in meters}]
    return Sampler(meters, interval_s)


def machine_model(root: str | Path = "/") -> str | None:
    """The board's name: the device tree's model on Jetson and other ARM boards, DMI's product name on a PC."""
    for path in MODEL_FILES:
        text = optional_text(under(root, path))
        if text:
            return text
    return None


def describe_machine(root: str | Path = "/", sampler: Sampler | None = None) -> dict:
    """The machine, its power mode, battery, thermal headroom and meters: what a profile records about where it
    was measured. Only facts about the hardware: no host name, no user."""
    meters, missing = find_meters(root)
    mode = power_mode(root)
    battery = battery_state(root)
    room = headroom_c(read_zones(root))
    real = Path(root) == Path("/")
    return {
        "model": machine_model(root),
        "arch": platform.machine() if real else None,
        "cpus": os.cpu_count() if real else None,
        "kernel": platform.release() if real else None,
        "power_mode": asdict(mode) if mode else None,
        "battery": asdict(battery),
        "thermal_headroom_c": None if room is None else {"celsius": room[0], "zone": room[1].type},
        "meters": {
            "chosen": sampler.source if sampler is not None else meters[0].source,
            "sampler": sampler.describe() if sampler is not None else None,
            "available": [m.describe() for m in meters],
            "unavailable": missing,
        },
    }
