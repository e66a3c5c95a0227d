"""`edgekit profile`: per-stage timings of one report, a merged trace and an op-time plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.options import (
    BundleArgument,
    Engine,
    EngineOption,
    ForceOption,
    JsonOption,
    PromptOption,
    StudyOption,
    ThreadsOption,
    engine_name,
    examples,
    out_option,
)
from edgekit.cli.output import console, emit, warn

app = typer.Typer(help="Measure where a bundle's time goes on a target.")


@app.command(
    epilog=examples(
        "edgekit profile out/radreport-tiny-cpu --study models/samples/ct_chest -o out/profile",
        "edgekit profile out/radreport-tiny-x1 -s models/samples/cr_chest -o out/profile-x1 --json",
        "edgekit profile out/radreport-tiny-x1 -s models/samples/cr_chest -o out/profile-x1 --dense --force",
        "edgekit build --target orin -o out/radreport-tiny-orin --no-parity && edgekit profile "
        "out/radreport-tiny-orin --engine onnxruntime -s models/samples/cr_chest -o out/profile-orin",
        note="Open out/profile/trace.json in https://ui.perfetto.dev or chrome://tracing. An x1 bundle profiles on the "
        "emulator: emulated time and energy per op, layer and token (ops/layers/tokens/layer_types .json and "
        ".csv), a trace with the LOAD/COMPUTE/STORE queues and layer_types.png. An orin bundle off the Jetson "
        "profiles with --engine onnxruntime: ONNX Runtime's kernel trace of its graphs on this CPU (not TensorRT's), "
        "the report billed by the Orin cost model (estimated, not measured).",
    )
)
def profile(
    bundle: BundleArgument,
    study: StudyOption,
    prompt: PromptOption = "",
    out: Annotated[
        Path,
        out_option("Folder for trace.json, the tables, the plot (cpu: ops.png; x1: layer_types.png) and profile.json."),
    ] = Path("out/profile"),
    force: ForceOption = False,
    threads: ThreadsOption = None,
    dense: Annotated[bool, typer.Option("--dense", help="x1: run without dynamic head sparsity.")] = False,
    engine: EngineOption = Engine.default,
    as_json: JsonOption = False,
) -> None:
    """Run one report with the target's profiler; write a chrome trace, tables and a plot."""
    from edgekit.profiling import profile_report

    result = profile_report(
        bundle,
        study,
        prompt,
        out,
        threads=threads,
        settings={"dss": False} if dense else None,
        engine=engine_name(engine),
    )
    for message in result.get("warnings", []):  # the report's: what ingest skipped or changed
        warn(message)
    if as_json:
        emit(result, True)
        return
    emit(result["summary"], False, title=result["summary_title"])
    for title, rows in result["tables"].items():
        emit(rows, False, title=title)
    console.print(f"trace: {result['trace']} (Perfetto / chrome://tracing) · plot: {result['plot']}")
