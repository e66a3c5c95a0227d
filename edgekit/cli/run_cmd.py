"""`edgekit run`: one study in, one report out."""

from __future__ import annotations

import typer

from edgekit.cli.common import (
    BundleArgument,
    JsonOption,
    MaxNewTokensOption,
    PromptOption,
    SeedOption,
    StudyOption,
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
        note="Sampling flags override the bundle's generation config (greedy unless --temperature is above 0).",
    )
)
def run(
    bundle: BundleArgument,
    study: StudyOption,
    prompt: PromptOption = "",
    max_new_tokens: MaxNewTokensOption = None,
    temperature: TemperatureOption = 0.0,
    top_p: TopPOption = 1.0,
    seed: SeedOption = None,
    threads: ThreadsOption = None,
    as_json: JsonOption = False,
) -> None:
    """Write a report: findings, impression, and where the time went."""
    from edgekit.reporter import Reporter

    reporter = Reporter.from_bundle(bundle, threads=threads)
    options = reporter.options(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
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
    err_console.print(
        f"[dim]{report.model} on {report.target} · {report.modality} study {report.study} · "
        f"{t['total_ms']:.0f} ms ({t['new_tokens']} tokens, {t.get('decode_tokens_per_s', 0):.0f} tok/s decode)[/dim]"
    )
