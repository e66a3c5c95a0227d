"""A parser for `tegrastats` lines, for the logs Jetson users already have (JetPack 6; JetPack 5 and 7 forms too).

One line, as JetPack 6 (L4T R36) prints it on AGX Orin:

    05-09-2026 18:42:06 RAM 18207/62841MB (lfb 466x4MB) SWAP 86/31420MB (cached 0MB) CPU [14%@2188,...,10%@1036]
    EMC_FREQ 3%@2133 GR3D_FREQ 0%@[0,0] NVENC 79%@166 NVDEC off ... APE 174 cpu@52.562C soc2@48.437C ...
    VDD_GPU_SOC 2412mW/2412mW VDD_CPU_CV 1607mW/1607mW VIN_SYS_5V0 4707mW/4707mW

Rails are `<name> <now>mW/<average>mW` (JetPack 7 adds a third figure); the board total follows
`edgekit.energy.rails` (VDD_IN on Orin Nano/NX, the sum of three rails on AGX Orin). CPU cores read `<load>%@<MHz>`
or `off`; temperatures `<zone>@<C>C`, where -256 C means the sensor is powered down. Anything the parser does not
know is kept in `unparsed`, not dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from edgekit.energy import rails
from edgekit.energy.reading import EnergyReading, measured
from edgekit.errors import EdgekitError

_PATTERNS = {
    "time": re.compile(r"^\s*(\d\d-\d\d-\d{4} \d\d:\d\d:\d\d)"),
    "ram": re.compile(r"\bRAM (\d+)/(\d+)MB(?: \(lfb [^)]*\))?"),
    "swap": re.compile(r"\bSWAP (\d+)/(\d+)MB(?: \(cached (\d+)MB\))?"),
    "cpu": re.compile(r"\bCPU \[([^\]]*)\](?:@(\d+))?"),
    "emc": re.compile(r"\bEMC_FREQ (\d+)%(?:@(\d+))?"),
    "gr3d": re.compile(r"\bGR3D_FREQ (?:(\d+)%)?(?:@\[?([\d,]+)\]?)?"),
    "rail": re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)mW/(\d+)mW(?:/(\d+)mW)?"),
    "temp": re.compile(r"\b([A-Za-z][\w]*)@(-?[\d.]+)C(?:/(-?[\d.]+)C)?"),
    "engine": re.compile(r"\b([A-Z][A-Z0-9_]*) (off|\d+%@\d+|\d+)\b"),
}
ABSENT_C = -256.0


class TegrastatsError(EdgekitError):
    """A line that is not tegrastats output."""

    code = "invalid_tegrastats"


@dataclass(frozen=True)
class CpuCore:
    load_pct: float | None  # None: the core is off
    mhz: int | None


@dataclass(frozen=True)
class TegrastatsSample:
    time: datetime | None = None
    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    swap_used_mb: int | None = None
    swap_total_mb: int | None = None
    cpus: tuple[CpuCore, ...] = ()
    emc_pct: float | None = None
    emc_mhz: int | None = None
    gr3d_pct: float | None = None
    gr3d_mhz: tuple[int, ...] = ()
    engines: dict[str, str] = field(default_factory=dict)  # NVENC "off", VIC "36%@115", APE "174"
    temps_c: dict[str, float | None] = field(default_factory=dict)  # None: sensor powered down (-256 C)
    rails_mw: dict[str, tuple[int, int]] = field(default_factory=dict)  # now, average
    unparsed: tuple[str, ...] = ()

    @property
    def total_rails(self) -> tuple[str, ...]:
        return rails.total_rails(self.rails_mw)

    @property
    def source(self) -> str:
        return measured(f"tegrastats:{rails.total_label(self.total_rails)}")

    def power_w(self, *, average: bool = False) -> float:
        """The board total now (or tegrastats' running average), W."""
        return sum(self.rails_mw[r][1 if average else 0] for r in self.total_rails) / 1e3

    @property
    def cpu_load_pct(self) -> float | None:
        """Mean load over the cores that are on."""
        on = [c.load_pct for c in self.cpus if c.load_pct is not None]
        return sum(on) / len(on) if on else None


def _cores(body: str, shared_mhz: str | None) -> tuple[CpuCore, ...]:
    out = []
    for item in filter(None, (s.strip() for s in body.split(","))):
        if item == "off":
            out.append(CpuCore(None, None))
            continue
        m = re.fullmatch(r"(\d+)%(?:@(\d+))?", item)
        if not m:
            raise ValueError(f"CPU core {item!r}")
        mhz = m.group(2) or shared_mhz
        out.append(CpuCore(float(m.group(1)), int(mhz) if mhz else None))
    return tuple(out)


def parse_line(line: str) -> TegrastatsSample:
    """One tegrastats line. TegrastatsError for a line with neither RAM nor a power rail in it."""
    rest = line.rstrip("\n")
    found: dict = {}

    def take(key: str, many: bool = False):
        nonlocal rest
        hits = list(_PATTERNS[key].finditer(rest))
        if not many:
            hits = hits[:1]
        for m in reversed(hits):
            rest = rest[: m.start()] + " " + rest[m.end() :]
        return hits if many else (hits[0] if hits else None)

    if m := take("time"):
        found["time"] = datetime.strptime(m.group(1), "%m-%d-%Y %H:%M:%S")
    if m := take("ram"):
        found["ram_used_mb"], found["ram_total_mb"] = int(m.group(1)), int(m.group(2))
    if m := take("swap"):
        found["swap_used_mb"], found["swap_total_mb"] = int(m.group(1)), int(m.group(2))
    if m := take("cpu"):
        try:
            found["cpus"] = _cores(m.group(1), m.group(2))
        except ValueError as e:
            raise TegrastatsError(f"not a tegrastats line: {e}") from None
    if m := take("emc"):
        found["emc_pct"] = float(m.group(1))
        found["emc_mhz"] = int(m.group(2)) if m.group(2) else None
    if m := take("gr3d"):
        found["gr3d_pct"] = float(m.group(1)) if m.group(1) else None
        found["gr3d_mhz"] = tuple(int(x) for x in m.group(2).split(",") if x) if m.group(2) else ()
    found["rails_mw"] = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in take("rail", many=True)}
    temps = {}
    for m in take("temp", many=True):
        c = float(m.group(2))
        temps[m.group(1)] = None if c <= ABSENT_C else c
    found["temps_c"] = temps
    found["engines"] = {m.group(1): m.group(2) for m in take("engine", many=True)}
    if "ram_used_mb" not in found and not found["rails_mw"]:
        raise TegrastatsError(f"not a tegrastats line (no RAM, no power rail): {line[:60]!r}")
    found["unparsed"] = tuple(rest.split())
    return TegrastatsSample(**found)


def parse_log(lines: Iterable[str], where=None) -> list[TegrastatsSample]:
    """Every non-blank line; TegrastatsError naming the file and line number of the first bad one."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse_line(line))
        except TegrastatsError as e:
            raise TegrastatsError(f"line {n}: {e.reason}", where) from None
    return out


def log_energy(samples: list[TegrastatsSample], interval_s: float) -> EnergyReading:
    """The energy over a log taken at `tegrastats --interval` (ms / 1000): the trapezoid of the instantaneous
    totals, one `interval_s` apart (the timestamps have only whole seconds)."""
    if len(samples) < 2:
        raise TegrastatsError("a log needs two lines or more to integrate")
    watts = [s.power_w() for s in samples]
    joules = sum(0.5 * (a + b) * interval_s for a, b in zip(watts, watts[1:]))
    return EnergyReading(joules, interval_s * (len(samples) - 1), samples[0].source, samples=len(samples))
