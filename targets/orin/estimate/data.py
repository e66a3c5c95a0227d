"""devices.toml, read and checked: each Orin module, its nvpmodel power modes, and where every number comes from.

Why a module of its own: the data file is the cost model's only source of numbers, so its parsing and its checks
(a missing field or an unknown source is one error naming the device and field) live apart from the arithmetic
that uses them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

from edgekit.compat import tomllib  # tomli on JetPack 6's Python 3.10
from edgekit.errors import ConfigError

DATA_FILE = "devices.toml"
DATA_PACKAGE = "edgekit.targets.orin"  # devices.toml ships beside the target's modules, not in this subpackage
DEFAULT_DEVICE = "agx-orin-64"
DEFAULT_MODE = "MAXN"


@dataclass(frozen=True)
class PowerMode:
    """One nvpmodel mode: its budget and the caps it sets (device maxima where the mode leaves them free)."""

    name: str
    nvpmodel_id: int
    nvpmodel_name: str
    budget_w: float
    gpu_tpcs: int
    gpu_mhz: float
    emc_mhz: float
    dla_mhz: float
    unconstrained: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class Device:
    id: str
    name: str
    label: str  # the model part of the figure label: estimated:orin-<label>-<mode>
    gpu_tpcs: int
    gpu_cuda_cores: int
    gpu_tensor_cores: int
    gpu_max_mhz: float
    dla_cores: int
    dla_max_mhz: float
    memory_gb: float
    memory_bus_bits: int
    emc_max_mhz: float
    memory_bandwidth_gbs: float
    power_min_w: float
    power_max_w: float
    total_sparse_int8_tops: float
    modes: dict[str, PowerMode]
    provenance: dict[str, str]
    unverified: tuple[str, ...] = ()

    def mode(self, name: str) -> PowerMode:
        """The mode called `name` (case-insensitive; nvpmodel's own names such as MODE_30W work too)."""
        want = str(name).strip().upper()
        for m in self.modes.values():
            if want in (m.name.upper(), m.nvpmodel_name.upper(), f"MODE_{m.name.upper()}"):
                return m
        raise ConfigError(f"{self.id} has no power mode '{name}' (known: {', '.join(self.modes)})")


@dataclass(frozen=True)
class OrinData:
    devices: dict[str, Device]
    architecture: dict[str, float]
    assumptions: dict[str, float]
    sources: dict[str, dict[str, str]]
    references: dict[str, dict[str, Any]]
    raw: dict[str, Any] = field(repr=False, compare=False)


DEVICE_FIELDS = tuple(f.name for f in dataclasses.fields(Device) if f.name not in ("id", "modes", "provenance"))
MODE_FIELDS = tuple(f.name for f in dataclasses.fields(PowerMode) if f.name != "name")


@functools.lru_cache(maxsize=1)
def load_data() -> OrinData:
    """devices.toml as shipped in the package (importlib.resources, so the wheel finds it as the checkout does)."""
    text = files(DATA_PACKAGE).joinpath(DATA_FILE).read_text(encoding="utf-8")
    return parse_data(tomllib.loads(text), DATA_FILE)


def parse_data(raw: dict[str, Any], where: str) -> OrinData:
    """Validate the data file: a missing field or an unknown source is one error naming the device and field."""
    sources = raw.get("sources", {})
    devices = {}
    for dev_id, d in raw.get("devices", {}).items():
        missing = [f for f in DEVICE_FIELDS if f not in d and f != "unverified"]
        if missing:
            raise ConfigError(f"device '{dev_id}' lacks {', '.join(missing)}", where)
        modes = {}
        for mode_name, m in d.get("modes", {}).items():
            lacking = [f for f in MODE_FIELDS if f not in m]
            if lacking:
                raise ConfigError(f"device '{dev_id}' mode '{mode_name}' lacks {', '.join(lacking)}", where)
            if m["source"] not in sources:
                raise ConfigError(f"device '{dev_id}' mode '{mode_name}' cites unknown source '{m['source']}'", where)
            modes[mode_name] = PowerMode(name=mode_name, **{**m, "unconstrained": tuple(m["unconstrained"])})
        if not modes:
            raise ConfigError(f"device '{dev_id}' has no power modes", where)
        provenance = dict(d.get("provenance", {}))
        for f, src in provenance.items():
            if src not in sources:
                raise ConfigError(f"device '{dev_id}' field '{f}' cites unknown source '{src}'", where)
        fields_ = {f: d[f] for f in DEVICE_FIELDS if f in d}
        fields_["unverified"] = tuple(d.get("unverified", ()))
        devices[dev_id] = Device(id=dev_id, modes=modes, provenance=provenance, **fields_)
    arch = {k: float(v) for k, v in raw.get("architecture", {}).items() if k != "provenance"}
    assumptions = {k: float(v["value"]) for k, v in raw.get("assumptions", {}).items()}
    return OrinData(devices, arch, assumptions, sources, raw.get("references", {}), raw)


def known_devices() -> dict[str, tuple[str, ...]]:
    """Device id -> its power-mode names, in the data file's order."""
    return {dev_id: tuple(d.modes) for dev_id, d in load_data().devices.items()}


def get_device(device: str | Device) -> Device:
    """A device by id (agx-orin-64) or label (agx64); a `Device` passes through (tests vary one field)."""
    if isinstance(device, Device):
        return device
    devices = load_data().devices
    want = str(device).strip().lower()
    for d in devices.values():
        if want in (d.id, d.label):
            return d
    raise ConfigError(f"unknown Orin device '{device}' (known: {', '.join(devices)})")
