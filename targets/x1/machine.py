"""The X1 machine description: one TOML file holds every parameter the compiler, emulator and cost model use.

Why one validated file: a latency or energy figure is only meaningful next to the machine it was computed for,
so every program and report is stamped with `Machine.hash`, the sha256 of the canonical content (sections and
keys sorted, numbers normalised to their declared type, comments and layout ignored). A missing, unknown or
absurd parameter is a `ConfigError` naming the field (`sram.kv_banks`), never a silently wrong estimate.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from edgekit.compat import tomllib
from edgekit.errors import ConfigError

DEFAULT_MACHINE = Path(__file__).with_name("x1-default.toml")
ISA_VERSIONS = (1,)


@dataclass(frozen=True)
class Param:
    """One scalar field: its type and the range outside which a value is a typo, not a design."""

    kind: type
    lo: float | None = None
    hi: float | None = None
    doc: str = ""


# section -> field -> Param. Bounds are deliberately wide: they catch unit slips (GB/s typed as TB/s, MiB as
# bytes), not unusual designs.
SCHEMA: dict[str, dict[str, Param]] = {
    "machine": {
        "name": Param(str, doc="identifier printed in reports"),
        "isa_version": Param(int, 1, 1, "ISA the programs for this machine use"),
        "description": Param(str),
    },
    "process": {
        "node_nm": Param(float, 2, 180, "logic node the energies are scaled to"),
        "supply_v": Param(float, 0.4, 1.5, "core supply voltage"),
    },
    "clock": {"ghz": Param(float, 0.05, 5.0, "core clock")},
    "matrix": {
        "int4_weights_per_cycle": Param(int, 1, 1 << 20, "INT4 weights the near-memory MAC lanes consume"),
        "int8_weights_per_cycle": Param(int, 1, 1 << 20),
        "fp16_weights_per_cycle": Param(int, 1, 1 << 20),
        "rows": Param(int, 1, 1024, "token rows each fetched weight is applied to in one cycle"),
    },
    "attention": {
        "macs_per_kv_bank": Param(int, 1, 4096, "INT8xINT4 MACs per cycle beside each KV bank"),
    },
    "vector": {
        "lanes": Param(int, 1, 1 << 16, "FP16 vector lanes"),
        "rmsnorm_ops": Param(float, 1, 64, "vector ops per element, RMSNorm (+ INT8 quantise of the output)"),
        "rope_ops": Param(float, 1, 64),
        "softmax_ops": Param(float, 1, 64),
        "silu_mul_ops": Param(float, 1, 64),
        "residual_ops": Param(float, 1, 64),
        "quantize_ops": Param(float, 1, 64, "per element, FP16 -> INT8/INT4 with a group scale"),
    },
    "sram": {
        "banks": Param(int, 1, 4096),
        "bank_kib": Param(float, 1, 65536),
        "kv_banks": Param(int, 1, 4096, "banks holding the KV cache; the rest hold activations"),
        "port_bytes_per_cycle": Param(int, 1, 4096, "per bank"),
    },
    "near_memory": {
        "capacity_gib": Param(float, 0.01, 1024, "weights the near-memory compute can stream"),
        "bandwidth_gbs": Param(float, 1, 100_000, "aggregate weight stream into the MAC lanes, GB/s"),
    },
    "dram": {
        "kind": Param(str),
        "capacity_gib": Param(float, 0.01, 4096),
        "bandwidth_gbs": Param(float, 0.1, 10_000, "external DRAM, GB/s"),
    },
    "numerics": {
        "weight_group_size": Param(int, 8, 4096, "INT4/INT8 weights per FP16 scale, along K"),
        "scale_bits": Param(int, 8, 32),
        "activation_bits": Param(int, 4, 16),
        "accumulator_bits": Param(int, 16, 64),
        "kv_bits": Param(int, 2, 16),
        "kv_group_size": Param(int, 8, 4096),
    },
    "queues": {
        "op_overhead_cycles": Param(float, 0, 1e6, "dispatch + pipeline fill + dependency-token wait per op"),
    },
    "power": {"static_w": Param(float, 0, 500, "leakage, clocks and DRAM refresh while a token runs")},
}

# Every action the emulator counts; each needs an energy and a source in [energy.<action>].
ENERGY_ACTIONS = (
    "mac_int4xint8",
    "mac_int8xint8",
    "mac_fp16",
    "group_rescale",
    "vector_op",
    "sram_read_bit",
    "sram_write_bit",
    "near_memory_read_bit",
    "dram_read_bit",
    "dram_write_bit",
)
ENERGY_PJ_MAX = 1000.0  # no single action costs a nanojoule; above that a unit slipped (nJ written as pJ)


@dataclass(frozen=True)
class Energy:
    """One action's energy at the machine's node. `pj_45nm` set means it was scaled from Horowitz's 45 nm table."""

    pj: float
    source: str
    pj_45nm: float | None = None


class Section:
    """Read-only attribute access to one validated section (`machine.sram.kv_banks`)."""

    def __init__(self, name: str, values: Mapping[str, Any]):
        self._name, self._values = name, MappingProxyType(dict(values))

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"{self._name}.{key}") from None

    def __repr__(self) -> str:
        return f"Section({self._name}, {dict(self._values)})"


class Machine:
    """A validated machine description. Build with `load_machine(path)` or `Machine.from_dict(d)`."""

    # one Section per SCHEMA section, set in __init__ (tests/test_x1_machine.py checks the two lists agree)
    machine: Section
    process: Section
    clock: Section
    matrix: Section
    attention: Section
    vector: Section
    sram: Section
    near_memory: Section
    dram: Section
    numerics: Section
    queues: Section
    power: Section

    def __init__(self, content: dict, path: str | None = None):
        self.content = content  # canonical: validated and type-normalised
        self.path = path
        for section in SCHEMA:
            setattr(self, section, Section(section, content[section]))
        self.logic_energy_scale = logic_energy_scale(content["process"]["node_nm"], content["process"]["supply_v"])
        self.energy: dict[str, Energy] = {}
        for action in ENERGY_ACTIONS:
            entry = content["energy"][action]
            if "pj_45nm" in entry:
                self.energy[action] = Energy(
                    entry["pj_45nm"] * self.logic_energy_scale, entry["source"], entry["pj_45nm"]
                )
            else:
                self.energy[action] = Energy(entry["pj"], entry["source"])
        self.hash = canonical_hash(content)

    @property
    def short_hash(self) -> str:
        return self.hash[:16]

    # Derived rates the cost model and the emulator share, so both read one definition.
    @property
    def hz(self) -> float:
        return self.clock.ghz * 1e9

    @property
    def bank_bytes(self) -> float:
        return self.sram.bank_kib * 1024

    @property
    def kv_sram_bytes(self) -> float:
        return self.sram.kv_banks * self.bank_bytes

    @property
    def kv_sram_bandwidth(self) -> float:
        """Bytes/s the KV banks' ports deliver to the attention MACs beside them."""
        return self.sram.kv_banks * self.sram.port_bytes_per_cycle * self.hz

    @property
    def act_sram_bandwidth(self) -> float:
        """Bytes/s of the activation (non-KV) banks."""
        return (self.sram.banks - self.sram.kv_banks) * self.sram.port_bytes_per_cycle * self.hz

    @property
    def near_memory_bandwidth(self) -> float:
        return self.near_memory.bandwidth_gbs * 1e9

    @property
    def near_memory_bytes(self) -> float:
        return self.near_memory.capacity_gib * 2**30

    @property
    def dram_bandwidth(self) -> float:
        return self.dram.bandwidth_gbs * 1e9

    def weight_bits(self, dtype: str) -> float:
        """Stored bits per weight, group scales included (INT4 with FP16 scales per 64: 4.25)."""
        n = self.numerics
        if dtype == "fp16":
            return 16.0
        return {"int4": 4, "int8": 8}[dtype] + n.scale_bits / n.weight_group_size

    @property
    def kv_bits(self) -> float:
        """Stored bits per cached K or V value, group scale included."""
        n = self.numerics
        return n.kv_bits + (n.scale_bits / n.kv_group_size if n.kv_bits < 16 else 0)

    def to_dict(self) -> dict:
        return {"name": self.machine.name, "hash": self.hash, "path": self.path}

    @classmethod
    def from_dict(cls, d: Mapping, path: str | Path | None = None) -> Machine:
        return cls(validate(d, path), None if path is None else str(path))


def logic_energy_scale(node_nm: float, supply_v: float) -> float:
    """E ~ C V^2 with C ~ feature size: (node / 45 nm) x (V / 0.9 V)^2, from Horowitz's 45 nm, 0.9 V table."""
    return (node_nm / 45.0) * (supply_v / 0.9) ** 2


def _check_scalar(field: str, value: Any, p: Param, path) -> Any:
    if p.kind is str:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"field '{field}' must be a non-empty string, got {value!r}", path)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"field '{field}' must be a number, got {value!r}", path)
    if p.kind is int and not float(value).is_integer():
        raise ConfigError(f"field '{field}' must be an integer, got {value!r}", path)
    if not math.isfinite(value):
        raise ConfigError(f"field '{field}' must be finite, got {value!r}", path)
    if (p.lo is not None and value < p.lo) or (p.hi is not None and value > p.hi):
        raise ConfigError(f"field '{field}' = {value!r} is absurd (expected {p.lo:g} .. {p.hi:g})", path)
    return p.kind(value)


def _check_energy(d: Mapping, path) -> dict:
    if not isinstance(d, Mapping):
        raise ConfigError("field 'energy' must be a table of actions", path)
    for action in d:
        if action not in ENERGY_ACTIONS:
            raise ConfigError(f"unknown field 'energy.{action}' (known: {', '.join(ENERGY_ACTIONS)})", path)
    out = {}
    for action in ENERGY_ACTIONS:
        name = f"energy.{action}"
        entry = d.get(action)
        if entry is None:
            raise ConfigError(f"missing field '{name}'", path)
        if not isinstance(entry, Mapping):
            raise ConfigError(f"field '{name}' must be a table with pj or pj_45nm, and source", path)
        extra = set(entry) - {"pj", "pj_45nm", "source"}
        if extra:
            raise ConfigError(f"unknown field '{name}.{sorted(extra)[0]}'", path)
        if ("pj" in entry) == ("pj_45nm" in entry):
            raise ConfigError(
                f"field '{name}' needs exactly one of 'pj' (at the machine's node) or 'pj_45nm' "
                "(scaled by the process section)",
                path,
            )
        key = "pj" if "pj" in entry else "pj_45nm"
        value = _check_scalar(f"{name}.{key}", entry[key], Param(float, 0, ENERGY_PJ_MAX), path)
        if value <= 0:
            raise ConfigError(f"field '{name}.{key}' must be positive, got {value!r}", path)
        if "source" not in entry:
            raise ConfigError(f"missing field '{name}.source' (every energy states where it comes from)", path)
        out[action] = {key: value, "source": _check_scalar(f"{name}.source", entry["source"], Param(str), path)}
    return out


def validate(d: Mapping, path: str | Path | None = None) -> dict:
    """Check every section and field; return the canonical content (types normalised) or raise ConfigError."""
    if not isinstance(d, Mapping):
        raise ConfigError("machine description must be a table", path)
    for section in d:
        if section not in SCHEMA and section != "energy":
            raise ConfigError(f"unknown field '{section}' (known sections: {', '.join([*SCHEMA, 'energy'])})", path)
    out: dict[str, Any] = {}
    for section, params in SCHEMA.items():
        values = d.get(section)
        if values is None:
            raise ConfigError(f"missing field '{section}'", path)
        if not isinstance(values, Mapping):
            raise ConfigError(f"field '{section}' must be a table", path)
        for key in values:
            if key not in params:
                raise ConfigError(f"unknown field '{section}.{key}'", path)
        sec = {}
        for key, p in params.items():
            if key not in values:
                raise ConfigError(f"missing field '{section}.{key}'", path)
            sec[key] = _check_scalar(f"{section}.{key}", values[key], p, path)
        out[section] = sec
    if "energy" not in d:
        raise ConfigError("missing field 'energy'", path)
    out["energy"] = _check_energy(d["energy"], path)
    _check_consistency(out, path)
    return out


def _check_consistency(c: dict, path) -> None:
    """Relations between fields that each look fine alone."""
    if c["sram"]["kv_banks"] >= c["sram"]["banks"]:
        raise ConfigError(
            f"field 'sram.kv_banks' = {c['sram']['kv_banks']} leaves no activation banks "
            f"(sram.banks = {c['sram']['banks']})",
            path,
        )
    if c["machine"]["isa_version"] not in ISA_VERSIONS:
        raise ConfigError(f"field 'machine.isa_version' = {c['machine']['isa_version']} is not supported", path)
    m = c["matrix"]
    if not m["int4_weights_per_cycle"] >= m["int8_weights_per_cycle"] >= m["fp16_weights_per_cycle"]:
        raise ConfigError(
            "field 'matrix.int8_weights_per_cycle' must lie between the INT4 and FP16 rates "
            "(narrower weights never stream slower)",
            path,
        )
    n = c["numerics"]
    if n["weight_group_size"] & (n["weight_group_size"] - 1) or n["kv_group_size"] & (n["kv_group_size"] - 1):
        raise ConfigError("field 'numerics.weight_group_size' / 'numerics.kv_group_size' must be a power of two", path)
    if n["accumulator_bits"] < n["activation_bits"] + 4 + math.log2(n["weight_group_size"]):
        raise ConfigError(
            f"field 'numerics.accumulator_bits' = {n['accumulator_bits']} can overflow within a "
            "weight group (needs activation_bits + 4 + log2(group) bits)",
            path,
        )


def canonical_hash(content: Mapping) -> str:
    """sha256 of the canonical JSON: stable across key order, comments, whitespace and 1 vs 1.0."""
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_machine(path: str | Path | None = None) -> Machine:
    """Read and validate a machine description (the bundled `x1-default.toml` when `path` is None)."""
    p = Path(path) if path is not None else DEFAULT_MACHINE
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("machine description not found", p) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read machine description: {err}", p) from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"not valid TOML: {err}", p) from err
    return Machine.from_dict(raw, p)
