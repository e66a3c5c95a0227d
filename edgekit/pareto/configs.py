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
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KNOBS = ("max_new_tokens", "video_max_frames", "sparsity_target", "threads", "orin_estimate")
TARGET_KNOBS = {"sparsity_target": ("x1",), "orin_estimate": ("orin",)}  # knobs only some targets have


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


def expand(bundles: Sequence[Any], grid: dict[str, Sequence[Any]]) -> list[Config]:
    """Every bundle x every combination of the knobs its target has (`bundles`: loaded `Bundle`s). A point is named
    by its bundle's file name (`radreport-tiny-x1`), which users choose per variant; two bundles of the same file
    name get their digest's first 8 characters too."""
    stems = [Path(b.source).name.removesuffix(".ekb") for b in bundles]
    out = []
    for b, stem in zip(bundles, stems):
        name = stem if stems.count(stem) == 1 else f"{stem}@{b.digest[:8]}"
        names = [k for k in KNOBS if b.target in TARGET_KNOBS.get(k, (b.target,))]
        values = [list(grid.get(k) or [None]) for k in names]
        for combo in itertools.product(*values):
            settings = {k: v for k, v in zip(names, combo) if v is not None}
            out.append(Config(Path(b.source), name, b.target, b.digest, settings))
    return out
