"""`edgekit profile`'s library side: one report on a bundle's target with the target's profiler on.

The target's run side writes what its profiler measures (ORT kernel traces on cpu: `edgekit.ort.trace`; emulated
instruction records on x1) as a chrome trace, tables and a plot; this module only orchestrates and saves the
summary as profile.json.
"""

from __future__ import annotations

import json
from pathlib import Path


def profile_report(
    bundle_path, study, prompt: str, out: Path, *, threads: int | None = None, settings: dict | None = None
) -> dict:
    """One report on the bundle's target with its profiler on; the target's run side writes the trace, tables and
    plot into `out` (ORT kernel traces on cpu, emulated instruction records on x1). Returns profile.json's body."""
    import shutil

    from edgekit.bundle import load_bundle
    from edgekit.plugins import load_backend
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    b = load_bundle(bundle_path)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "raw"
    shutil.rmtree(raw, ignore_errors=True)
    backend = load_backend(b, RuntimeOptions(threads=threads, profile_dir=raw, settings=settings or {}))
    report = Reporter(b, backend=backend).report(study, prompt)
    prof = backend.write_profile(report, out)
    result = {
        "bundle": b.name,
        "target": b.target,
        **prof["details"],
        "timings_ms": report.timings,
        "cost": report.cost,
        "warnings": report.warnings,
        "summary": prof["summary"],
        "summary_title": prof["summary_title"],
        "tables": prof["tables"],
        "files": prof["files"],
        "trace": prof["trace"],
        "plot": prof["plot"],
        "source": prof["source"],
    }
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    return result
