"""The configurations `edgekit pareto` measures: each bundle times the run-time knobs that change its cost.

Knobs (each a list; one value means "not varied"):
- `max_new_tokens`: a cap on the report's length (None: the bundle's generation config);
- `video_max_frames`: frames decoded per clip (the seed's 30 -> 15 fps frame skipping; DICOM studies unchanged);
- `sparsity_target`: the X1's DSS target (x1 bundles only; None: the bundle's own setting);
- `threads`: ONNX Runtime / emulator threads (None: physical cores);
- `orin_estimate`: `DEVICE:MODE` of an Orin and its power mode (orin bundles only): the bundle's graphs run in ONNX
  Runtime here and each report is billed by the Orin cost model (`estimated:orin-<model>-<mode>`), an Orin front
  before anyone holds an Orin; several values are a grid over devices and power modes.
Image size is fixed by the exported vision graph, and batch size by a daemon that does not batch yet, so neither
is a knob here.

`orin_estimate` says which device bills the figures (each value is a front of its own), not what a report costs;
the others are the cost knobs. With no cost knob given, `edgekit pareto` measures `DEFAULT_GRID`: each bundle at
its own settings, then each knob's values one at a time from there (a star, not every combination: 5 points per
cpu or x1 bundle, so the embedded model's full test split stays a matter of minutes per bundle).

Which knobs a target has is still written here (`TARGET_KNOBS`, `DEFAULT_GRID`'s targets), not in the targets'
plug-ins: moving it means a `pareto_knobs` attribute on `edgekit.target.Target` and the knob -> runtime-setting
mapping of `measure.runtime_settings` with it (issue #30's weight-format work edits the same plug-ins).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

KNOBS = ("max_new_tokens", "video_max_frames", "sparsity_target", "threads", "orin_estimate")
TARGET_KNOBS = {"sparsity_target": ("x1",), "orin_estimate": ("orin",)}  # knobs only some targets have
DEVICE_KNOBS = ("orin_estimate",)  # where the figures come from, not what a report costs: never a default grid

# What `edgekit pareto` varies when no cost knob is given, each value alone from the bundle's own settings, and
# on which targets (None: every target that has the knob). Threads change only a host-timed target's figures:
# the X1's emulated clock and the Orin estimate do not see the host's threads.
DEFAULT_GRID: dict[str, tuple[tuple[Any, ...], tuple[str, ...] | None]] = {
    "max_new_tokens": ((32, 24), None),  # report-length caps (radreport-tiny's own: 77)
    "video_max_frames": ((4,), None),  # frame skipping: 4 frames per clip (radreport-tiny's own: 8)
    "sparsity_target": ((0.0,), ("x1",)),  # DSS off (the bundle's own target: 0.38 unless built otherwise)
    "threads": ((1,), ("cpu",)),  # one thread (default: the physical cores)
}


@dataclass(frozen=True)
class Config:
    bundle: Path
    name: str  # the variant's name: its bundle's file name
    target: str
    digest: str
    settings: dict[str, Any] = field(default_factory=dict)  # only the knobs that are set

    @property
    def id(self) -> str:
        knobs = ",".join(f"{k}={v}" for k, v in sorted(self.settings.items()))
        return f"{self.name}[{knobs}]" if knobs else self.name


def _names(bundles: Sequence[Any]) -> list[str]:
    """A point is named by its bundle's file name (`radreport-tiny-x1`), which users choose per variant; two bundles
    of the same file name get their digest's first 8 characters too."""
    stems = [Path(b.source).name.removesuffix(".ekb") for b in bundles]
    return [stem if stems.count(stem) == 1 else f"{stem}@{b.digest[:8]}" for b, stem in zip(bundles, stems)]


def _has(target: str, knob: str) -> bool:
    return target in TARGET_KNOBS.get(knob, (target,))


def expand(bundles: Sequence[Any], grid: dict[str, Sequence[Any]]) -> list[Config]:
    """Every bundle x every combination of the knobs its target has (`bundles`: loaded `Bundle`s)."""
    out = []
    for b, name in zip(bundles, _names(bundles)):
        names = [k for k in KNOBS if _has(b.target, k)]
        values = [list(grid.get(k) or [None]) for k in names]
        for combo in itertools.product(*values):
            settings = {k: v for k, v in zip(names, combo) if v is not None}
            out.append(Config(Path(b.source), name, b.target, b.digest, settings))
    return out


def default_grid(target: str) -> dict[str, tuple[Any, ...]]:
    """The knobs `DEFAULT_GRID` varies on `target`, and their values."""
    return {
        k: values
        for k, (values, targets) in DEFAULT_GRID.items()
        if _has(target, k) and (targets is None or target in targets)
    }


def expand_default(bundles: Sequence[Any], devices: dict[str, Sequence[Any]] | None = None) -> list[Config]:
    """Every bundle at its own settings, then at each value of its target's `DEFAULT_GRID` knobs, one knob at a
    time; for each of the `devices` values it has (`orin_estimate`), which are fronts of their own."""
    out = []
    for base in expand(bundles, {k: v for k, v in (devices or {}).items() if k in DEVICE_KNOBS}):
        out.append(base)
        for knob, values in default_grid(base.target).items():
            out += [replace(base, settings={**base.settings, knob: v}) for v in values]
    return out


def describe_default_grid() -> str:
    """`DEFAULT_GRID` in words, for `--help` and the output."""
    parts = []
    for knob, (values, targets) in DEFAULT_GRID.items():
        where = f" ({', '.join(targets)})" if targets else ""
        parts.append(f"{knob} {', '.join(map(str, values))}{where}")
    return "; ".join(parts)


def plan(
    bundles: Sequence[Any], knobs: dict[str, Sequence[Any] | None], *, use_default: bool = True
) -> tuple[list[Config], dict[str, Any]]:
    """The configurations `edgekit pareto` measures for `knobs` (its flags: a list per knob, None where not
    given), and what was varied as pareto.json records it (`grid`): the given knobs in every combination; with
    no cost knob given, `DEFAULT_GRID` one knob at a time (unless not `use_default`: one point per bundle)."""
    given = {k: list(v) for k, v in knobs.items() if v}
    if any(k not in DEVICE_KNOBS for k in given):
        return expand(bundles, given), {"kind": "flags", "knobs": given, "combined": "every combination"}
    if not use_default:
        return expand(bundles, given), {"kind": "none", "devices": given}
    grid = {
        "kind": "default",
        "knobs": {k: {"values": list(v), "targets": list(t) if t else "all"} for k, (v, t) in DEFAULT_GRID.items()},
        "devices": given,
        "combined": "one knob at a time, from each bundle's own settings",
    }
    return expand_default(bundles, given), grid


def _values(knobs: dict[str, Any]) -> str:
    return "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in knobs.items())


def describe_grid(grid: dict[str, Any]) -> str:
    """A `plan` grid in one line, for the output."""
    if grid["kind"] == "flags":
        return f"grid: {_values(grid['knobs'])} (every combination)"
    on = f", for each of {_values(grid['devices'])}" if grid.get("devices") else ""
    if grid["kind"] == "default":
        return f"grid: the default, one knob at a time from each bundle's own settings: {describe_default_grid()}{on}"
    return f"grid: none, each bundle at its own settings{on}"
