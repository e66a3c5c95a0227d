"""One configuration measured on an eval split: what becomes one point of the Pareto profile.

Run in a child process per configuration (`python -m edgekit.pareto.measure CONFIG.json OUT.json`), so peak
memory is that configuration's own (`ru_maxrss` of a fresh process) and one configuration's crash costs only its
point.

Where each figure comes from: the target's run side says, through each report's cost.
- latency: the report's wall clock here (`measured:wall-clock`), unless the cost states the device's own latency
  (x1's emulator: `emulated:x1`, without the host's ingest and preprocessing; an Orin estimate);
- energy per report: the target's own cost where it bills one (`emulated:x1`, `estimated:orin-<model>-<mode>`:
  an estimate, never a measurement); elsewhere the best meter this machine has (a sensor: `measured:<sensor>`;
  else an estimate: `estimated:<model>`), integrated over each report's generation and shared evenly with the
  reports that decoded beside it (`max_batch`: the split is reported that many at a time).
A target's own knobs reach its run side as the runtime settings its plug-in declares (`Target.pareto_knobs`).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.energy.reading import weakest
from edgekit.pareto.configs import Config, target_knobs
from edgekit.pareto.profile import Point


def _latency_and_energy(record: dict) -> tuple[float, str, float | None, str | None]:
    """A target whose cost states its own latency (x1's emulator) is timed by it, not by the host's clock."""
    cost = record.get("cost") or {}
    if "latency_ms" in cost:
        latency, latency_source = cost["latency_ms"], cost["figure_source"]
    else:
        latency, latency_source = record["timings"]["total_ms"], "measured:wall-clock"
    return latency, latency_source, record.get("energy_j"), record.get("energy_source")


def runtime_settings(settings: dict[str, Any], target: str) -> dict[str, Any]:
    """The knobs that are `target`'s run-time settings (`RuntimeOptions.settings`), in its own words: each of its
    plug-in's `pareto_knobs` that is set (orin's `orin_estimate`: its graphs in ONNX Runtime, billed by the Orin
    estimate); the core's knobs are applied by the reporter and ingest, not here."""
    runtime: dict[str, Any] = {}
    for name, knob in target_knobs(target).items():
        if name in settings:
            runtime.update(knob.settings(settings[name]))
    return runtime


def peak_rss_mib() -> float:
    """The measuring process's peak (one per point), plus its largest ingest process's: a batched point decodes
    its studies there, an unbatched one in-process. The kernel keeps only the largest reaped child's peak, so with
    two ingest processes this is a floor."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) / 1024


def measure(config: Config, data_dir: Path, *, limit: int | None, meter=None) -> dict[str, Any]:
    """The point for `config`, as `Point.to_dict()`."""
    from edgekit.bundle import load_bundle
    from edgekit.eval.runner import evaluate
    from edgekit.ingest.study import IngestLimits
    from edgekit.ort import serving_threads
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    settings = dict(config.settings)
    runtime = runtime_settings(settings, config.target)
    t0 = time.perf_counter()
    bundle = load_bundle(config.bundle)
    limits = IngestLimits(video_max_frames=settings["video_max_frames"]) if "video_max_frames" in settings else None
    # as edgekitd serves a model beside its ingest (half the physical cores, pool threads not spinning between
    # runs: `edgekit/daemon/cpu_share.py`), so that the policy's and the canary's figures are the daemon's
    options = RuntimeOptions(
        threads=settings.get("threads") or serving_threads(), settings=runtime, spin_between_runs=False
    )
    batch = {"max_batch": settings["max_batch"]} if "max_batch" in settings else {}
    reporter = Reporter(bundle, runtime=options, meter=meter, limits=limits, **batch)
    reporter.warm()
    load_ms = (time.perf_counter() - t0) * 1e3
    opts = reporter.options(max_new_tokens=settings.get("max_new_tokens"))
    in_flight = int(settings.get("max_batch") or 1)  # the split reported this many at a time
    result = evaluate(reporter, data_dir, limit=limit, include_video=True, options=opts, concurrency=in_flight)
    ok = [r for r in result["records"] if r.get("error") is None]
    if not ok:
        raise RuntimeError(f"{config.id}: every report failed")
    latency, latency_sources, energy, energy_sources = zip(*(_latency_and_energy(r) for r in ok))
    if any(e is None for e in energy):
        energy_j, energy_source = float("nan"), "none: no meter on this machine"
    else:  # a mean over reports a meter's fallback billed takes the weaker label, as any mixed figure does
        energy_j, energy_source = float(np.mean(energy)), weakest(dict.fromkeys(energy_sources))
    overall, video = result["overall"], result.get("video") or {}
    video_f1 = video.get("finding_f1")
    return Point(
        id=config.id,
        bundle=str(config.bundle),
        bundle_digest=config.digest,
        target=config.target,
        settings={**settings, "variant": config.name},
        f1=overall["finding_f1"]["value"],
        f1_ci=tuple(overall["finding_f1"]["ci95"]),
        hallucination_rate=overall["hallucinated_finding_rate"],
        latency_p50_ms=float(np.percentile(latency, 50)),
        latency_p95_ms=float(np.percentile(latency, 95)),
        energy_j=energy_j,
        energy_source=energy_source,
        peak_rss_mib=peak_rss_mib(),
        count=overall["n"],  # DICOM studies scored (cine clips' MP4 copies are timed, billed and scored apart)
        load_ms=load_ms,
        recipe=bundle.manifest.provenance.get("recipe"),
        latency_source=latency_sources[0],
        failed=len(result["records"]) - len(ok),
        video_f1=video_f1["value"] if video_f1 else None,
        video_f1_ci=tuple(video_f1["ci95"]) if video_f1 else None,
        video_count=video.get("n", 0),
    ).to_dict()


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    config = Config(Path(spec["bundle"]), spec["name"], spec["target"], spec["digest"], spec["settings"])
    meter = None
    if spec.get("meter"):
        from edgekit.pareto.energy import open_meter

        meter = open_meter(spec["meter"])
    out = measure(config, Path(spec["data"]), limit=spec.get("limit"), meter=meter)
    Path(argv[1]).write_text(json.dumps(out, indent=2))
    return 0


def spec_for(config: Config, data_dir: Path, limit: int | None, meter: str | None) -> dict[str, Any]:
    return {**asdict(config), "bundle": str(config.bundle), "data": str(data_dir), "limit": limit, "meter": meter}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
