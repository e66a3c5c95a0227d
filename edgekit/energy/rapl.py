"""Intel/AMD RAPL energy counters through Linux powercap: `/sys/class/powercap/intel-rapl:<n>[:<m>]/`.

Each zone has `name` (`package-0`, `core`, `uncore`, `dram`, `psys`), `energy_uj` (µJ since some point, wrapping
at `max_energy_range_uj`). Top-level zones `intel-rapl:<n>` are packages (and `psys`, the whole platform on
some laptops); `intel-rapl:<n>:<m>` are parts of a package and are not added again. The total is the sum of the
`package-*` zones: what the CPU sockets (cores, caches, memory controller, integrated GPU) drew, not the board.

Since CVE-2020-8694 (Platypus: power side channel, November 2020) the kernel makes `energy_uj` readable by root
only; an unprivileged process gets one clear error naming the file and the CVE, and edgekit falls back to the
next meter.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from edgekit.energy.counters import Unwrapper
from edgekit.energy.reading import MeterReadError, MeterUnavailableError, PowerReading, measured
from edgekit.energy.sysfs import matching, optional_int, optional_text, read_int

ZONE_GLOB = "/sys/class/powercap/intel-rapl:*"
CVE_NOTE = (
    "not readable by this user: since CVE-2020-8694 (Platypus) the kernel lets only root read RAPL energy "
    "counters; run as root, or grant read access to this file (a udev rule or tmpfiles.d entry)"
)


@dataclass(frozen=True)
class Zone:
    path: Path
    name: str
    max_range_uj: int | None

    @property
    def energy_file(self) -> Path:
        return self.path / "energy_uj"

    @property
    def top_level(self) -> bool:
        return re.fullmatch(r"intel-rapl:\d+", self.path.name) is not None


def find_zones(root: str | Path = "/") -> list[Zone]:
    return [
        Zone(d, optional_text(d / "name") or d.name, optional_int(d / "max_energy_range_uj"))
        for d in matching(root, ZONE_GLOB)
        if (d / "energy_uj").exists()
    ]


def read_uj(zone: Zone) -> int:
    """One zone's counter; MeterUnavailableError naming the file and the CVE when it may not be read."""
    try:
        return read_int(zone.energy_file)
    except PermissionError:
        raise MeterUnavailableError(CVE_NOTE, zone.energy_file) from None


class RaplMeter:
    """The sum of the package zones as one counter meter (joules since opened; watts over the last interval)."""

    def __init__(self, root: str | Path = "/"):
        zones = [z for z in find_zones(root) if z.top_level]
        packages = [z for z in zones if z.name.startswith("package")] or [z for z in zones if z.name != "psys"]
        if not packages:
            raise MeterUnavailableError("no RAPL package zone in powercap", Path(root) / ZONE_GLOB.lstrip("/"))
        self.zones = packages
        self.other_zones = [z for z in find_zones(root) if z not in packages]
        self.source = measured("rapl:" + "+".join(z.name for z in packages))
        self._counters = [Unwrapper(read_uj(z), z.max_range_uj) for z in packages]  # raises on CVE-2020-8694
        self._last = (time.monotonic(), 0.0)

    def read(self) -> PowerReading:
        t = time.monotonic()
        try:
            joules = sum(c.update(read_int(z.energy_file)) for z, c in zip(self.zones, self._counters)) / 1e6
        except (OSError, ValueError) as e:
            raise MeterReadError(f"{self.source}: {e}") from e
        t0, j0 = self._last
        self._last = (t, joules)
        watts = (joules - j0) / (t - t0) if t > t0 else None
        return PowerReading(watts, self.source, t, energy_j=joules)

    def describe(self) -> dict:
        return {
            "source": self.source,
            "kind": "energy counter",
            "zones": [{"name": z.name, "zone": z.path.name, "max_energy_range_uj": z.max_range_uj} for z in self.zones],
            "not_summed": [z.name for z in self.other_zones],
            "note": "CPU packages only (cores, caches, memory controller, integrated GPU), not the board",
        }
