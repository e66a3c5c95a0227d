"""The Pareto profile: what `edgekit pareto` writes and edgekitd's policy reads (`pareto.json`), in one place.

A point is one configuration (a bundle, by its digest, plus the run-time knobs that change its cost) with what it
measured on an eval split: latency, energy per report with the energy's source, peak memory and finding F1 with
its 95% interval. The front is the points no other point beats on all of energy, F1 and latency.

Fronts are per device: a `Front` holds the points whose figures come from one place, one energy source and one
latency source (this machine's meter and wall clock; the X1 emulator; the Orin cost model at one device and power
mode). An emulated millijoule and an estimated joule, or 1 ms of emulated NPU time and 645 ms of wall clock, are
not the same quantity, so points of different fronts are never compared: `non_dominated` refuses a mixed list, and
a profile of cpu and x1 bundles has two fronts, each with its own plot panel and table.

`f1` scores the split's DICOM studies. Where the split has video clips (cine loops as MP4), their F1 is kept
apart (`video_f1`): a knob that changes only video (frame skipping) must show its cost in quality there, so two
points that both have it are compared on it too, and the daemon's quality floor holds for it as well.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError

SCHEMA = "edgekit.pareto/1"


@dataclass(frozen=True)
class Point:
    id: str  # the bundle's file name plus its knobs, e.g. "radreport-tiny-x1[sparsity_target=0.5]"
    bundle: str  # the path it was measured from (information; identity is `bundle_digest`)
    bundle_digest: str
    target: str
    settings: Mapping[str, Any]  # run-time knobs: max_new_tokens, frames, sparsity_target, threads ...
    f1: float
    f1_ci: tuple[float, float]
    hallucination_rate: float
    latency_p50_ms: float
    latency_p95_ms: float
    energy_j: float  # per report, mean over the split
    energy_source: str  # measured:<sensor> | emulated:x1 | estimated:<model>
    peak_rss_mib: float
    count: int  # studies measured
    load_ms: float = 0.0  # load + warm-up time of the bundle: the policy stays at least this long
    recipe: str | None = None
    latency_source: str = "measured:wall-clock"  # or the target's own clock (emulated:x1, estimated:orin-...)
    failed: int = 0  # studies whose report failed (not in the figures)
    video_f1: float | None = None  # finding F1 on the split's video clips (None: none measured)
    video_f1_ci: tuple[float, float] | None = None
    video_count: int = 0  # video clips scored

    @property
    def in_flight(self) -> int:
        """Reports running at once when it was measured: its `max_batch` knob (the split reported that many at a
        time, decoded together; no more than the split held), else one."""
        return max(1, min(int(self.settings.get("max_batch") or 1), self.count + self.video_count))

    @property
    def power_w(self) -> float:
        """Average power while its reports run: the energy of the reports in flight over the median latency (one
        report's energy over its latency when they run one at a time)."""
        if self.latency_p50_ms <= 0:
            return math.inf
        return self.in_flight * self.energy_j / (self.latency_p50_ms / 1e3)

    @property
    def drain_p95_ms(self) -> float:
        """How fast a deep queue drains: p95 latency per report in flight (a batch of 8 whose reports take twice
        one report's time clears a queue four times as fast). The policy's `fast` objective under load."""
        return self.latency_p95_ms / self.in_flight

    @property
    def lowest_f1(self) -> float:
        """The lower of the DICOM and the video F1: what a quality floor must hold for."""
        return self.f1 if self.video_f1 is None else min(self.f1, self.video_f1)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["settings"] = dict(self.settings)
        out["f1_ci"] = list(self.f1_ci)
        out["video_f1_ci"] = list(self.video_f1_ci) if self.video_f1_ci is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: Path | str) -> Point:
        try:
            point = cls(
                **{
                    **data,
                    "settings": dict(data.get("settings") or {}),
                    "f1_ci": tuple(data["f1_ci"]),
                    "video_f1_ci": tuple(data["video_f1_ci"]) if data.get("video_f1_ci") is not None else None,
                }
            )
            rows = point.settings.get("max_batch", 1)  # edgekitd caps an engine at it: never below one row
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
                raise ValueError(f"max_batch must be an integer >= 1, not {rows!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"profile point {data.get('id', '?')!r} is malformed ({exc})", where) from None
        return point


def _energy(p: Point) -> float:
    """Unknown energy (no meter: NaN) as the worst: it never beats a known figure, and NaN compares false both
    ways, which would put every unmetered point on the front."""
    return math.inf if math.isnan(p.energy_j) else p.energy_j


def front_key(p: Point) -> tuple[str, str]:
    """Where a point's figures come from: its energy source and its latency source. Points compare only when
    both are the same."""
    return (p.energy_source, p.latency_source)


def dominates(a: Point, b: Point) -> bool:
    """`a` is no worse than `b` on energy, F1 and p95 latency (and video F1 when both have it), and better on at
    least one. Both must be of one front (`front_key`): `non_dominated` checks that."""
    ea, eb = _energy(a), _energy(b)
    no_worse = ea <= eb and a.f1 >= b.f1 and a.latency_p95_ms <= b.latency_p95_ms
    better = ea < eb or a.f1 > b.f1 or a.latency_p95_ms < b.latency_p95_ms
    if a.video_f1 is not None and b.video_f1 is not None:
        no_worse = no_worse and a.video_f1 >= b.video_f1
        better = better or a.video_f1 > b.video_f1
    return no_worse and better


def non_dominated(points: Iterable[Point]) -> list[Point]:
    """The Pareto front over energy x F1 x latency, cheapest first, of points of one front; points whose figures
    come from different sources are refused (split them with `split_fronts`)."""
    points = list(points)
    keys = sorted({front_key(p) for p in points})
    if len(keys) > 1:
        seen = "; ".join(f"energy {e}, latency {lat}" for e, lat in keys)
        raise ConfigError(f"points with figures from different sources are not compared on one front ({seen})")
    front = [p for p in points if not any(dominates(q, p) for q in points if q is not p)]
    return sorted(front, key=lambda p: (_energy(p), -p.f1))


@dataclass(frozen=True)
class Front:
    """The points of one device: one energy source and one latency source, and their non-dominated ones."""

    energy_source: str
    latency_source: str
    points: tuple[Point, ...]

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.target for p in self.points))

    @property
    def device(self) -> str:
        """What the figures describe: a cost model that states both latency and energy is its own device (the X1
        emulator, the Orin estimate at one power mode); otherwise the host's clock and meter are: this machine."""
        if self.latency_source == self.energy_source and ":" in self.energy_source:
            kind, model = self.energy_source.split(":", 1)
            return f"{model} ({kind})"
        return "this machine"

    @property
    def label(self) -> str:
        targets = ", ".join(self.targets)
        return f"{self.device}, target {targets}: energy {self.energy_source}, latency {self.latency_source}"

    @property
    def front(self) -> list[Point]:
        return non_dominated(self.points)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "device": self.device,
            "targets": list(self.targets),
            "energy_source": self.energy_source,
            "latency_source": self.latency_source,
            "points": [p.id for p in self.points],
            "front": [p.id for p in self.front],
        }


def split_fronts(points: Iterable[Point]) -> list[Front]:
    """`points` by where their figures come from, in the order each front's first point comes."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        groups.setdefault(front_key(p), []).append(p)
    return [Front(energy, latency, tuple(ps)) for (energy, latency), ps in groups.items()]


@dataclass
class Profile:
    points: list[Point]
    split: dict[str, Any] = field(default_factory=dict)  # {"name": "test", "count": 300, "source": ...}
    machine: dict[str, Any] = field(default_factory=dict)
    meters: list[dict[str, Any]] = field(default_factory=list)
    source: Path | None = None
    grid: dict[str, Any] = field(default_factory=dict)  # the knobs varied: {"kind": "default" | "flags", ...}

    @property
    def fronts(self) -> list[Front]:
        """One front per device (energy and latency source): `edgekit pareto` on cpu and x1 bundles has two."""
        return split_fronts(self.points)

    @property
    def front(self) -> list[Point]:
        """The non-dominated points of every front, front after front (each compared only within its own)."""
        return [p for f in self.fronts for p in f.front]

    def by_id(self) -> dict[str, Point]:
        return {p.id: p for p in self.points}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "split": self.split,
            "machine": self.machine,
            "meters": self.meters,
            "grid": self.grid,
            "points": [p.to_dict() for p in self.points],
            "fronts": [f.to_dict() for f in self.fronts],
            "front": [p.id for p in self.front],  # every front's, for readers of one front
        }


def read_profile(path: str | os.PathLike) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("no such Pareto profile (write one with `edgekit pareto`)", path) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"not a readable Pareto profile ({exc})", path) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ConfigError(f"not a Pareto profile (expected schema {SCHEMA!r})", path)
    points = [Point.from_dict(p, path) for p in data.get("points") or []]
    if not points:
        raise ConfigError("the Pareto profile has no points", path)
    return Profile(
        points,
        data.get("split") or {},
        data.get("machine") or {},
        data.get("meters") or [],
        path,
        data.get("grid") or {},
    )


def write_profile(profile: Profile, path: str | os.PathLike) -> Path:
    """Atomically: a profile is rewritten after every point (resumable), and a reader must never see half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
