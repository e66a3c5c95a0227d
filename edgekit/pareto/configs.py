"""The configurations `edgekit pareto` measures: each bundle times the run-time knobs that change its cost.

Knobs (each a list; one value means "not varied"). The core's, which every target has:
- `max_new_tokens`: a cap on the report's length (None: the bundle's generation config);
- `video_max_frames`: frames decoded per clip (the seed's 30 -> 15 fps frame skipping; DICOM studies unchanged);
- `threads`: ONNX Runtime / emulator threads (None: as edgekitd serves a model, half the physical cores, its pool
  threads not spinning between runs);
- `max_batch`: reports in flight at once. The split is reported this many at a time, and the token engine decodes
  them together (`edgekit.engine`): energy per report at a full batch, each report's latency with the others
  beside it, and `Point.power_w` the device's draw while the batch stays full. edgekitd's policy caps its
  engine's rows at the served point's value. None: one report at a time. In the default grid of the targets that
  bill a batch as it runs (cpu's host meter, shared per step; x1's emulator, per row), not orin's estimate, which
  bills each report as if alone.
And each target's own, declared by its plug-in (`edgekit.target.Target.pareto_knobs`: the runtime setting each
sets, its default-grid values, whether it names a device): x1's `sparsity_target` (the DSS target), orin's
`orin_estimate` (`DEVICE:MODE`: the graphs run in ONNX Runtime here and the Orin cost model bills each report, an
Orin front before anyone holds an Orin). Image size is fixed by the exported vision graph, so it is not a knob.

A device knob (`orin_estimate`) says which device bills the figures (each value is a front of its own), not what a
report costs; the others are the cost knobs. With no cost knob given, `edgekit pareto` measures the default grid:
each bundle at its own settings, then each of `CORE_GRID`'s and its target's default values one at a time from
there (a star, not every combination: 6 points per cpu or x1 bundle, so the embedded model's full test split
stays a matter of minutes per bundle).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgekit.plugins import TARGETS, get_target, target_names
from edgekit.target import ParetoKnob

CORE_KNOBS = ("max_new_tokens", "video_max_frames", "threads", "max_batch")  # every target's: the core applies them
# The core knobs' default-grid values, on every target (a target adds its own and the core's it wants varied: cpu's
# threads, since only a host-timed target's figures see the host's threads)
CORE_GRID: dict[str, tuple[Any, ...]] = {
    "max_new_tokens": (32, 24),  # report-length caps (radreport-tiny's own: 77)
    "video_max_frames": (4,),  # frame skipping: 4 frames per clip (radreport-tiny's own: 8)
}


def target_knobs(target: str) -> dict[str, ParetoKnob]:
    """The plug-in's `pareto_knobs` (none for a plug-in without them, or a target this install does not have)."""
    if target not in TARGETS:
        return {}
    return dict(getattr(get_target(target), "pareto_knobs", None) or {})


def knobs_of(target: str) -> tuple[str, ...]:
    """The knobs a bundle of `target` has: the core's, then its own."""
    own = [k for k, knob in target_knobs(target).items() if knob.setting is not None and k not in CORE_KNOBS]
    return CORE_KNOBS + tuple(own)


def _loadable_targets() -> Iterator[str]:
    for name in target_names():
        try:
            get_target(name)
        except ImportError:  # a target this install cannot load has no knobs here
            continue
        yield name


def device_knobs() -> frozenset[str]:
    """Knobs that say where the figures come from, not what a report costs: never a default grid."""
    return frozenset(k for t in _loadable_targets() for k, knob in target_knobs(t).items() if knob.device)


def default_grid(target: str) -> dict[str, tuple[Any, ...]]:
    """The knobs the default grid varies on `target`, and their values: `CORE_GRID` and the plug-in's `grid`s."""
    own = {k: knob.grid for k, knob in target_knobs(target).items() if knob.grid and not knob.device}
    grid = {**CORE_GRID, **own}
    return {k: grid[k] for k in knobs_of(target) if k in grid}


class _DefaultGrid(Mapping[str, tuple[tuple[Any, ...], tuple[str, ...] | None]]):
    """The default grid of every registered target as `{knob: (values, targets or None for all)}`, read from the
    plug-ins when used (not when this module is imported), for `--help` and pareto.json's record."""

    def _table(self) -> dict[str, tuple[tuple[Any, ...], tuple[str, ...] | None]]:
        table: dict[str, tuple[tuple[Any, ...], tuple[str, ...] | None]] = {k: (v, None) for k, v in CORE_GRID.items()}
        for target in _loadable_targets():
            for knob, values in default_grid(target).items():
                if knob in CORE_GRID and values == CORE_GRID[knob]:
                    continue
                had, targets = table.get(knob, ((), ()))
                table[knob] = (tuple(dict.fromkeys((*had, *values))), (*(targets or ()), target))
        return table

    def __getitem__(self, knob: str) -> tuple[tuple[Any, ...], tuple[str, ...] | None]:
        return self._table()[knob]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


DEFAULT_GRID: Mapping[str, tuple[tuple[Any, ...], tuple[str, ...] | None]] = _DefaultGrid()


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


def expand(bundles: Sequence[Any], grid: Mapping[str, Sequence[Any]]) -> list[Config]:
    """Every bundle x every combination of the knobs its target has (`bundles`: loaded `Bundle`s)."""
    out = []
    for b, name in zip(bundles, _names(bundles)):
        names = list(knobs_of(b.target))
        values = [list(grid.get(k) or [None]) for k in names]
        for combo in itertools.product(*values):
            settings = {k: v for k, v in zip(names, combo) if v is not None}
            out.append(Config(Path(b.source), name, b.target, b.digest, settings))
    return out


def expand_default(bundles: Sequence[Any], devices: Mapping[str, Sequence[Any]] | None = None) -> list[Config]:
    """Every bundle at its own settings, then at each value of its target's default-grid knobs, one knob at a
    time; for each of the `devices` values it has (`orin_estimate`), which are fronts of their own."""
    out = []
    device = device_knobs()
    for base in expand(bundles, {k: v for k, v in (devices or {}).items() if k in device}):
        out.append(base)
        for knob, values in default_grid(base.target).items():
            out += [replace(base, settings={**base.settings, knob: v}) for v in values]
    return out


def describe_default_grid() -> str:
    """The default grid in words, for `--help` and the output."""
    parts = []
    for knob, (values, targets) in DEFAULT_GRID.items():
        where = f" ({', '.join(targets)})" if targets else ""
        parts.append(f"{knob} {', '.join(map(str, values))}{where}")
    return "; ".join(parts)


def plan(
    bundles: Sequence[Any], knobs: Mapping[str, Sequence[Any] | None], *, use_default: bool = True
) -> tuple[list[Config], dict[str, Any]]:
    """The configurations `edgekit pareto` measures for `knobs` (its flags: a list per knob, None where not
    given), and what was varied as pareto.json records it (`grid`): the given knobs in every combination; with
    no cost knob given, the default grid one knob at a time (unless not `use_default`: one point per bundle)."""
    given = {k: list(v) for k, v in knobs.items() if v}
    if any(k not in device_knobs() for k in given):
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
