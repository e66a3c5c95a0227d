"""`edgekit pareto`'s loop: every configuration measured once, in its own process, into one resumable profile.

The profile is rewritten after each point, so an interrupted run keeps what it measured and the next run
measures only what is missing (a point is the same when its id and its bundle's digest are).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from edgekit.errors import EdgekitError
from edgekit.ingest.decode_threads import child_env
from edgekit.pareto.configs import Config
from edgekit.pareto.measure import spec_for
from edgekit.pareto.profile import Point, Profile, read_profile, write_profile

PROFILE_NAME = "pareto.json"


class PointFailedError(EdgekitError):
    code = "pareto_point_failed"


def _machine() -> dict:
    return {"python": platform.python_version(), "processor": platform.machine(), "cpus": os.cpu_count()}


def _previous(path: Path) -> dict[tuple[str, str], Point]:
    if not path.is_file():
        return {}
    try:
        return {(p.id, p.bundle_digest): p for p in read_profile(path).points}
    except EdgekitError:
        return {}  # unreadable: measure everything again (the file is rewritten whole)


def measure_point(config: Config, data_dir: Path, limit: int | None, meter: str | None) -> dict:
    """One configuration in a fresh process (its own peak memory; a crash costs one point)."""
    with tempfile.TemporaryDirectory(prefix="edgekit-pareto-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "point.json"
        spec.write_text(json.dumps(spec_for(config, data_dir, limit, meter)))
        proc = subprocess.run(
            [sys.executable, "-m", "edgekit.pareto.measure", str(spec), str(out)],
            capture_output=True,
            text=True,
            env=child_env(dict(os.environ)),  # its ingest workers share the CPUs as edgekitd's do
        )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise PointFailedError(f"measuring {config.id} failed: {tail}", config.bundle)
        return json.loads(out.read_text())


def run_pareto(
    configs: Sequence[Config],
    out_dir: Path,
    data_dir: Path,
    *,
    split: dict,
    limit: int | None = None,
    meter: str | None = None,
    meters: list[dict] | None = None,
    resume: bool = True,
    on_point: Callable[[Config, bool], None] = lambda _c, _reused: None,
    grid: dict | None = None,
) -> Profile:
    """Measure `configs` (keeping points already in `out_dir/pareto.json` when `resume`) and write the profile
    (`grid`: what was varied, recorded as said)."""
    path = out_dir / PROFILE_NAME
    previous = _previous(path) if resume else {}
    profile = Profile([], split=split, machine=_machine(), meters=meters or [], grid=grid or {})
    for config in configs:
        known = previous.get((config.id, config.digest))
        if known is not None and known.count >= (limit or 0):
            profile.points.append(known)
            on_point(config, True)
            continue
        profile.points.append(Point.from_dict(measure_point(config, data_dir, limit, meter), path))
        write_profile(profile, path)
        on_point(config, False)
    write_profile(profile, path)
    return profile
