"""Jetson's on-module INA3221 power monitors, read through sysfs (no tegrastats process, no jtop).

Two driver layouts exist:
- JetPack 5/6, the mainline `ina3221` hwmon driver: `/sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon<N>/`
  with `in<k>_label` (rail name), `in<k>_input` (bus voltage, mV), `curr<k>_input` (mA), `curr<k>_max` (warning
  limit, mA) and `curr<k>_crit` (critical limit, mA) for channels k = 1..3. Channel 7 is the "sum of shunt
  voltages" (µV, not a rail) and channels wired to nothing are labelled `NC`: both are skipped.
- JetPack 4 and older, NVIDIA's `ina3221x` IIO driver: `/sys/bus/i2c/drivers/ina3221x/<bus>-<addr>/iio:device<N>/`
  with `rail_name_<k>`, `in_voltage<k>_input` (mV), `in_current<k>_input` (mA), `in_power<k>_input` (mW),
  `warn_current_limit_<k>` and `crit_current_limit_<k>` (mA) for k = 0..2.

Power is V x I per rail (the IIO driver's own `in_power` only where a voltage or current is missing); the total
follows `edgekit.energy.rails`. Reading a rail costs two small file reads; the monitors average over their own
conversion window (`samples`, `update_interval`), so sampling faster than that repeats values.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from edgekit.energy import rails
from edgekit.energy.reading import MeterReadError, MeterUnavailableError, PowerReading, measured
from edgekit.energy.sysfs import matching, optional_int, read_int, read_text

HWMON_GLOB = "/sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*"
IIO_GLOB = "/sys/bus/i2c/drivers/ina3221x/*/iio:device*"
SUM_CHANNEL = 7  # hwmon: "sum of shunt voltages"


@dataclass(frozen=True)
class Channel:
    """One rail of one monitor, with the files that read it."""

    label: str
    driver: str  # "ina3221" (hwmon) or "ina3221x" (iio)
    device: str  # the I2C device, e.g. "1-0040"
    index: int
    volt_mv: Path | None
    curr_ma: Path | None
    power_mw: Path | None = None  # ina3221x only
    warn_ma: int | None = None  # currN_max / warn_current_limit_N
    crit_ma: int | None = None  # currN_crit / crit_current_limit_N

    def watts(self) -> float:
        if self.volt_mv is not None and self.curr_ma is not None:
            return read_int(self.volt_mv) * read_int(self.curr_ma) / 1e6
        if self.power_mw is not None:
            return read_int(self.power_mw) / 1e3
        raise ValueError(f"{self.device} {self.label}: neither voltage and current nor power to read")

    def limits(self) -> dict:
        """Current limits in A (what the monitor alarms at), None where the driver has none."""
        return {
            "warn_a": self.warn_ma / 1e3 if self.warn_ma is not None else None,
            "crit_a": self.crit_ma / 1e3 if self.crit_ma is not None else None,
        }


def _skip(label: str, index: int, layout: str) -> bool:
    return label.upper() == "NC" or "sum of shunt" in label.lower() or (layout == "hwmon" and index == SUM_CHANNEL)


def _device(path: Path, depth: int) -> str:
    return path.parents[depth].name


def hwmon_channels(root: str | Path) -> list[Channel]:
    out = []
    for d in matching(root, HWMON_GLOB):
        for label_file in sorted(d.glob("in*_label"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
            m = re.fullmatch(r"in(\d+)_label", label_file.name)
            if m is None:  # the glob also matches names with no channel number (in_label, inX_label)
                continue
            k = int(m.group(1))
            label = read_text(label_file)
            curr = d / f"curr{k}_input"
            if _skip(label, k, "hwmon") or not curr.exists():
                continue
            out.append(
                Channel(
                    label=label,
                    driver="ina3221",
                    device=_device(d, 1),
                    index=k,
                    volt_mv=d / f"in{k}_input",
                    curr_ma=curr,
                    warn_ma=optional_int(d / f"curr{k}_max"),
                    crit_ma=optional_int(d / f"curr{k}_crit"),
                )
            )
    return out


def iio_channels(root: str | Path) -> list[Channel]:
    out = []
    for d in matching(root, IIO_GLOB):
        for name_file in sorted(d.glob("rail_name_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])):
            k = int(name_file.name.rsplit("_", 1)[1])
            label = read_text(name_file)
            if _skip(label, k, "iio"):
                continue
            paths = {f: d / f"in_{f}{k}_input" for f in ("voltage", "current", "power")}
            files = {f: p if p.exists() else None for f, p in paths.items()}
            if files["power"] is None and None in (files["voltage"], files["current"]):
                continue
            out.append(
                Channel(
                    label=label,
                    driver="ina3221x",
                    device=_device(d, 0),
                    index=k,
                    volt_mv=files["voltage"],
                    curr_ma=files["current"],
                    power_mw=files["power"],
                    warn_ma=optional_int(d / f"warn_current_limit_{k}"),
                    crit_ma=optional_int(d / f"crit_current_limit_{k}"),
                )
            )
    return out


def find_channels(root: str | Path = "/") -> list[Channel]:
    """Every labelled rail on this board, JetPack 5/6 layout first; [] where there is no INA3221."""
    return hwmon_channels(root) or iio_channels(root)


class Ina3221Meter:
    """The board's INA3221 rails as one meter: total per `edgekit.energy.rails`, every rail in `rails`."""

    def __init__(self, root: str | Path = "/"):
        self.root = Path(root)
        self.channels = find_channels(root)
        if not self.channels:
            raise MeterUnavailableError(
                "no INA3221 power monitor (neither the ina3221 hwmon nor the ina3221x driver): not a Jetson",
                self.root / HWMON_GLOB.lstrip("/"),
            )
        labels = [c.label for c in self.channels]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise MeterUnavailableError(f"rail {dupes[0]!r} appears on two monitors", self.root / "sys/bus/i2c")
        self.total_rails = rails.total_rails(labels)
        self.source = measured(f"ina3221:{rails.total_label(self.total_rails)}")

    def read(self) -> PowerReading:
        t = time.monotonic()
        try:
            watts = {c.label: c.watts() for c in self.channels}
        except (OSError, ValueError) as e:
            raise MeterReadError(f"{self.source}: {e}") from e
        return PowerReading(sum(watts[r] for r in self.total_rails), self.source, t, rails=watts)

    def limits(self) -> dict[str, dict]:
        return {c.label: c.limits() for c in self.channels}

    def describe(self) -> dict:
        if self.total_rails == rails.AGX_ORIN_TOTAL:
            note = "the module's rails: the carrier board's own draw is not measured"
        elif len(self.total_rails) == 1 and self.total_rails[0] in rails.INPUT_RAILS:
            note = "the module's input rail"
        else:
            note = "the sum of every rail (no input rail known on this board)"
        return {
            "source": self.source,
            "kind": "power",
            "driver": self.channels[0].driver,
            "rails": [{"name": c.label, "device": c.device, "channel": c.index, **c.limits()} for c in self.channels],
            "total": list(self.total_rails),
            "note": note,
        }
