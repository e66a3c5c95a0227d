"""`edgekit profile`'s library side: one report on a bundle's target with the target's profiler on.

The target's run side writes what its profiler measures (ORT kernel traces on cpu: `edgekit.ort.trace`; emulated
instruction records on x1) as a chrome trace, tables and a plot; this module only orchestrates and saves the
summary as profile.json.
"""

from __future__ import annotations

import json
from pathlib import Path


def profile_report(
    bundle_path,
    study,
    prompt: str,
    out: Path,
    *,
    threads: int | None = None,
    settings: dict | None = None,
    engine: str | None = None,
) -> dict:
    """One report on the bundle's target with its profiler on; the target's run side writes the trace, tables and
    plot into `out` (ORT kernel traces on cpu, emulated instruction records on x1). `engine`: one of the target's
    engines (`RuntimeOptions.engine`; orin's `onnxruntime`: its graphs' ORT trace), None its own; on another than
    its own, the summary says so, and states what the report was billed (orin: the estimate). Returns
    profile.json's body."""
    import shutil

    from edgekit.bundle import load_bundle
    from edgekit.plugins import load_backend, resolve_engine
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    b = load_bundle(bundle_path)
    used, own = resolve_engine(b, engine), resolve_engine(b)  # an engine the target lacks: refused before `out`
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "raw"
    shutil.rmtree(raw, ignore_errors=True)
    options = RuntimeOptions(threads=threads, profile_dir=raw, settings=settings or {}, engine=engine)
    backend = load_backend(b, options)
    report = Reporter(b, backend=backend).report(study, prompt)
    prof = backend.write_profile(report, out)
    summary, title = prof["summary"], prof["summary_title"]
    if used != own:  # the target's own profile view states its own figures; another engine's says what it billed
        title = f"{title}: {b.target} via {used} (not {own})"
        if report.energy_j is not None and "latency_ms" in report.cost:
            billed = f"{report.cost['latency_ms']:.3g} ms, {report.energy_j * 1e3:.3g} mJ ({report.energy_source})"
            summary = {**summary, "billed / report": billed}
    result = {
        "bundle": b.name,
        "target": b.target,
        "engine": used,
        **prof["details"],
        "timings_ms": report.timings,
        "cost": report.cost,
        "energy_j": report.energy_j,
        "energy_source": report.energy_source,
        "warnings": report.warnings,
        "summary": summary,
        "summary_title": title,
        "tables": prof["tables"],
        "files": prof["files"],
        "trace": prof["trace"],
        "plot": prof["plot"],
        "source": prof["source"],
    }
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    return result
