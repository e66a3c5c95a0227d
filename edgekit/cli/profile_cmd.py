"""`edgekit profile`: per-stage timings of one report, a merged trace and an op-time plot."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.common import JsonOption, console, emit

app = typer.Typer(
    help="Measure where a bundle's time goes on a target.",
    epilog=(
        "Examples:\n\n"
        "  edgekit profile out/radreport-tiny-cpu --study models/samples/ct_chest -o out/profile\n\n"
        "  then open out/profile/trace.json in https://ui.perfetto.dev or chrome://tracing"
    ),
)


@app.command()
def profile(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory or .ekb file.", show_default=False)],
    study: Annotated[Path, typer.Option("--study", "-s", help="DICOM file, series folder, zip or video.")],
    prompt: Annotated[str, typer.Option("--prompt", "-p")] = "",
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for trace.json, ops.png, profile.json.")] = Path(
        "out/profile"),
    threads: Annotated[int | None, typer.Option(help="Intra-op threads (default: physical cores).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Run one report with ONNX Runtime profiling; write a chrome trace, an op table and a plot."""
    import json

    from edgekit.bundle import load_bundle
    from edgekit.profiling import merge_traces, op_summary, plot_ops
    from edgekit.reporter import Reporter
    from edgekit.targets import load_backend

    b = load_bundle(bundle)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "ort"
    shutil.rmtree(raw, ignore_errors=True)
    backend = load_backend(b, threads=threads, profile_dir=raw)
    report = Reporter(b, backend=backend).report(study, prompt)
    traces = backend.end_profiling()
    merge_traces(traces, out / "trace.json")
    ops = op_summary(traces)
    plot_ops(ops, out / "ops.png", f"{b.name} on {b.target}: one report ({report.timings['new_tokens']} tokens)")
    result = {"bundle": b.name, "target": b.target, "timings_ms": report.timings, "ops": ops[:15],
              "trace": str(out / "trace.json"), "plot": str(out / "ops.png"),
              "source": "ONNX Runtime profiler (kernel times) and wall clock (stages), one report"}
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    if as_json:
        emit(result, True)
        return
    emit({k: round(v, 2) if isinstance(v, float) else v for k, v in report.timings.items()}, False, title="stages")
    emit(ops[:12], False, title="kernel time by op type")
    console.print(f"trace: {out / 'trace.json'} (Perfetto / chrome://tracing) · plot: {out / 'ops.png'}")
