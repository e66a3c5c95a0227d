"""`edgekit run`: one study in, one report out; for a text model's bundle (a decoder alone), a prompt in."""

from __future__ import annotations

import typer

from edgekit.cli.common import (
    BundleArgument,
    JsonOption,
    MaxNewTokensOption,
    OptionalStudyOption,
    PromptOption,
    SeedOption,
    TemperatureOption,
    ThreadsOption,
    TopPOption,
    console,
    emit,
    err_console,
    examples,
    warn,
)

app = typer.Typer(help="Generate a report for a study with a bundle.")


@app.command(
    epilog=examples(
        "edgekit run out/radreport-tiny-cpu --study models/samples/ct_chest --prompt 'Cough and fever.'",
        "edgekit run out/radreport-tiny-x1 -s models/samples/cr_chest -p Follow-up.   # on the X1 emulator",
        "edgekit run out/radreport-tiny-cpu -s models/samples/us_cardiac/cine.mp4 --temperature 0.7 --top-p 0.9 "
        "--seed 1 --json",
        note="Sampling flags override the bundle's generation config (greedy unless --temperature is above 0). "
        "A text model's bundle (built from a LLaMA, Qwen2 or Mistral directory: docs/hf-import.md) takes no "
        "--study: edgekit run out/llama-cpu --prompt 'FINDINGS: 6 mm nodule, right upper lobe. Write the "
        "impression.'",
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
    as_json: JsonOption = False,
) -> None:
    """Write a report: findings, impression, and where the time went."""
    from edgekit.bundle import load_bundle
    from edgekit.errors import StudyRequiredError, TextModelError
    from edgekit.reporter import Reporter

    loaded = load_bundle(bundle)
    if loaded.is_text and study is not None:
        raise TextModelError("a text model's bundle (no vision graph) takes --prompt alone, not --study", bundle)
    if not loaded.is_text and study is None:
        raise StudyRequiredError("--study is required: this bundle is a vision-language model", bundle)
    reporter = Reporter.from_bundle(loaded, threads=threads)
    options = reporter.options(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    if loaded.is_text:
        report = reporter.report_text(prompt, options)
    else:
        report = reporter.report(study, prompt, options)
    for message in report.warnings:  # what ingest skipped or changed, what was capped; --json also lists them
        warn(message)
    if as_json:
        emit(report.to_dict(), True)
        return
    from rich.markup import escape

    console.print(f"[bold]FINDINGS:[/bold] {escape(report.findings_text)}", highlight=False)
    if report.impression:
        console.print(f"[bold]IMPRESSION:[/bold] {escape(report.impression)}", highlight=False)
    t = report.timings
    source = f"{report.modality} study {report.study}" if report.study else "text"
    err_console.print(
        f"[dim]{report.model} on {report.target} · {escape(source)} · "
        f"{t['total_ms']:.0f} ms ({t['new_tokens']} tokens, {t.get('decode_tokens_per_s', 0):.0f} tok/s decode)[/dim]"
    )
