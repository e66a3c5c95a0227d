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
        "  then open out/profile/trace.json in https://ui.perfetto.dev or chrome://tracing\n\n"
        "  An x1 bundle profiles on the emulator: emulated time and energy per op, layer and token\n\n"
        "  (ops/layers/tokens/layer_types .json and .csv), a trace with the LOAD/COMPUTE/STORE queues\n\n"
        "  and layer_types.png."
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
    dense: Annotated[bool, typer.Option("--dense", help="x1: run without dynamic head sparsity.")] = False,
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
    if b.target == "x1":
        _profile_x1(b, study, prompt, out, as_json, dense)
        return
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


def _profile_x1(b, study: Path, prompt: str, out: Path, as_json: bool, dense: bool) -> None:
    """One report on the X1 emulator: emulated (not wall) time and energy, by op, layer, token and layer type."""
    import json

    from edgekit.targets.x1.engine import SparseConfig, X1Engine
    from edgekit.targets.x1.trace import write_profile

    engine = X1Engine(b, SparseConfig(enable_sparsity=not dense))
    report = engine.report(study, prompt)
    stats = engine.last_stats
    tokens = report.timings["new_tokens"]
    m = engine.machine
    tables = write_profile(engine.history, m.hz, out, machine=m.machine.name,
                           title=f"{b.name} on x1 ({m.machine.name}): one report, {tokens} tokens, "
                                 f"{stats['emulated_ms_total']:.2f} ms, {stats['mj_total']:.2f} mJ emulated")
    result = {"bundle": b.name, "target": "x1", "machine": stats["machine"],
              "per_report": {"emulated_ms": stats["emulated_ms_total"], "mj": stats["mj_total"], "tokens": tokens},
              "per_token": {"emulated_ms": stats["emulated_ms_per_token"], "mj": stats["mj_per_token"]},
              "dss": stats.get("dss", {"sparsity_target": 0.0, "skip_rate": 0.0}),
              "phases": stats["phases"],
              "layers": [{k: r[k] for k in ("layer", "ms", "mj", "bound", "time_share")} for r in tables["layers"]],
              "layer_types": [{k: r[k] for k in ("layer_type", "ms", "mj", "bound", "time_share")}
                              for r in tables["layer_types"]],
              "wall_timings_ms": {k: v for k, v in report.timings.items() if k != "x1"},
              "files": tables["paths"],
              "source": "edgekit x1 emulator (emulated cycles and energy per instruction), one report"}
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    if as_json:
        emit(result, True)
        return
    emit({"emulated ms / report": round(stats["emulated_ms_total"], 3), "mJ / report": round(stats["mj_total"], 3),
          "emulated ms / token": round(stats["emulated_ms_per_token"], 4),
          "mJ / token": round(stats["mj_per_token"], 4), "tokens": tokens,
          "DSS skip rate / target": f"{stats['skip_rate']:.3f} / {stats['sparsity_target']:.2f}"},
         False, title=f"x1 emulated, machine {m.machine.name} ({m.short_hash})")
    emit([{"layer": r["layer"], "ms": round(r["ms"], 4), "mJ": round(r["mj"], 4), "bound": r["bound"]}
          for r in tables["layers"]], False, title="per layer")
    emit([{"layer type": r["layer_type"], "ms": round(r["ms"], 4), "mJ": round(r["mj"], 4), "bound": r["bound"]}
          for r in tables["layer_types"][:12]], False, title="by layer type")
    console.print(f"trace: {out / 'trace.json'} (Perfetto / chrome://tracing) · plot: {out / 'layer_types.png'}")
