"""`edgekit run`: one study in, one report out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.common import JsonOption, console, emit, err_console

app = typer.Typer(
    help="Generate a report for a study with a bundle.",
    epilog=(
        "Examples:\n\n"
        "  edgekit run out/radreport-tiny-cpu --study models/samples/ct_chest --prompt 'Cough and fever.'\n\n"
        "  edgekit run out/b --study clip.mp4 --temperature 0.7 --top-p 0.9 --seed 1 --json\n\n"
        "The study is a DICOM file, a folder holding one series, a .zip of one series, or a video file."
    ),
)


@app.command()
def run(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory or .ekb file.", show_default=False)],
    study: Annotated[Path, typer.Option("--study", "-s", help="DICOM file, series folder, zip or video.")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Clinical indication / request text.")] = "",
    max_new_tokens: Annotated[int | None, typer.Option(help="Default: the bundle's generation config.")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    threads: Annotated[int | None, typer.Option(help="Intra-op threads (default: physical cores).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Write a report: findings, impression, and where the time went."""
    from edgekit.errors import ConfigError
    from edgekit.reporter import Reporter

    if temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    reporter = Reporter.from_bundle(bundle, threads=threads)
    options = reporter.default_options
    if max_new_tokens is not None:
        options.max_new_tokens = max_new_tokens
    options.temperature, options.top_p, options.seed = temperature, top_p, seed
    report = reporter.report(study, prompt, options)
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
