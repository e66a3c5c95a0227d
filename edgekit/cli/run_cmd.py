"""`edgekit run`: one study in, one report out; for a text model's bundle (a decoder alone), a prompt in."""

from __future__ import annotations

import typer

from edgekit.cli.options import (
    BundleArgument,
    Engine,
    EngineOption,
    JsonOption,
    MaxNewTokensOption,
    OptionalStudyOption,
    PromptOption,
    SeedOption,
    TemperatureOption,
    ThreadsOption,
    TopPOption,
    engine_name,
    examples,
    runs_on,
)
from edgekit.cli.output import console, emit, err_console, warn

app = typer.Typer(help="Generate a report for a study with a bundle.")


@app.command(
    epilog=examples(
        "edgekit run out/radreport-tiny-cpu --study models/samples/ct_chest --prompt 'Cough and fever.'",
        "edgekit run out/radreport-tiny-x1 -s models/samples/cr_chest -p Follow-up.   # on the X1 emulator",
        "edgekit run out/radreport-tiny-cpu -s models/samples/us_cardiac/cine.mp4 --temperature 0.7 --top-p 0.9 "
        "--seed 1 --json",
        "edgekit build --target orin -o out/radreport-tiny-orin --no-parity && edgekit run out/radreport-tiny-orin "
        "--engine onnxruntime -s models/samples/cr_chest   # off the Jetson",
        note="Sampling flags override the bundle's generation config (greedy unless --temperature is above 0). "
        "A text model's bundle (built from a LLaMA, Qwen2 or Mistral directory: docs/hf-import.md) takes no "
        "--study: edgekit run out/llama-cpu --prompt 'FINDINGS: 6 mm nodule, right upper lobe. Write the "
        "impression.' An orin bundle runs on TensorRT on the Jetson; elsewhere --engine onnxruntime runs its ONNX "
        "graphs in ONNX Runtime on this CPU, and the report's latency and energy (cost, energy_j) are estimated by "
        "the Orin cost model (agx-orin-64 at MAXN), labelled estimated:orin-..., not measured.",
    )
)
def run(
    bundle: BundleArgument,
    study: OptionalStudyOption = None,
    prompt: PromptOption = "",
    max_new_tokens: MaxNewTokensOption = None,
    temperature: TemperatureOption = 0.0,
    top_p: TopPOption = 1.0,
    seed: SeedOption = None,
    threads: ThreadsOption = None,
    engine: EngineOption = Engine.default,
    as_json: JsonOption = False,
) -> None:
    """Write a report: findings, impression, and where the time went."""
    from edgekit.bundle import load_bundle
    from edgekit.errors import StudyRequiredError, TextModelError
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    loaded = load_bundle(bundle)
    if loaded.is_text and study is not None:
        raise TextModelError("a text model's bundle (no vision graph) takes --prompt alone, not --study", bundle)
    if not loaded.is_text and study is None:
        raise StudyRequiredError("--study is required: this bundle is a vision-language model", bundle)
    used, where = runs_on(loaded, engine_name(engine))
    reporter = Reporter.from_bundle(loaded, runtime=RuntimeOptions(threads=threads, engine=engine_name(engine)))
    options = reporter.options(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    if loaded.is_text:
        report = reporter.report_text(prompt, options)
    else:
        report = reporter.report(study, prompt, options)
    for message in report.warnings:  # what ingest skipped or changed, what was capped; --json also lists them
        warn(message)
    if as_json:
        emit({**report.to_dict(), "engine": used}, True)
        return
    from rich.markup import escape

    console.print(f"[bold]FINDINGS:[/bold] {escape(report.findings_text)}", highlight=False)
    if report.impression:
        console.print(f"[bold]IMPRESSION:[/bold] {escape(report.impression)}", highlight=False)
    t = report.timings
    source = f"{report.modality} study {report.study}" if report.study else "text"
    # what the target billed (x1: emulated; orin via onnxruntime: estimated), labelled, beside this machine's clock
    billed = (
        f" · {report.energy_source}: {report.cost['latency_ms']:.3g} ms, {report.energy_j * 1e3:.3g} mJ"
        if report.energy_j is not None and "latency_ms" in report.cost
        else ""
    )
    err_console.print(
        f"[dim]{escape(report.model)} on {escape(where)} · {escape(source)} · "
        f"{t['total_ms']:.0f} ms ({t['new_tokens']} tokens, {t.get('decode_tokens_per_s', 0):.0f} tok/s decode)"
        f"{escape(billed)}[/dim]"
    )
