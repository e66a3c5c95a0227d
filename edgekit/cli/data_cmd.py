"""`edgekit data`: make the synthetic studies radreport-tiny trains and is evaluated on.

Wired into the main CLI as the `data` group (`edgekit data synth OUT`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgekit.errors import ConfigError, EdgekitError

app = typer.Typer(
    help="Synthetic DICOM and video studies with ground-truth reports.",
    no_args_is_help=True,
    add_completion=False,
)

SYNTH_EPILOG = """\
Examples:

  edgekit data synth data/test

  edgekit data synth data/train --split train --count 4000

  edgekit data synth /tmp/s --count 8 --json

Writes OUT/studies.jsonl (id, modality, path, findings, negatives, indication, references per study) and one \
folder per study: DICOM slices (CT, MR), one image (CR/DX), or a multi-frame cine (US) plus the same loop as \
cine.mp4. Every run writes identical studies: each is a pure function of (split, index).
"""


@app.callback()
def _data() -> None:
    """Synthetic DICOM and video studies with ground-truth reports."""


@app.command("synth", epilog=SYNTH_EPILOG)
def synth(
    out: Path = typer.Argument(..., help="Folder to write (new or empty, or one holding the same split)."),
    split: str = typer.Option("test", "--split", help="train, val, test or sample: independent streams."),
    count: int = typer.Option(240, "--count", min=0, help="Number of studies (kinds rotate CT, MR, CR/DX, US)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary instead of a progress bar."),
) -> None:
    """Write COUNT synthetic studies of SPLIT into OUT with their ground truth."""
    from edgekit.models.synth.generator import SPLITS
    from edgekit.models.synth.splits import summarize, write_split

    err = Console(stderr=True)
    t0 = time.perf_counter()
    try:
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        if as_json:
            index = write_split(out, split, count)
        else:
            columns = (TextColumn(f"synth {split}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=err, transient=True) as bar:
                task = bar.add_task("studies", total=count)
                index = write_split(out, split, count, progress=lambda done, total: bar.update(task, completed=done))
    except EdgekitError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    summary = summarize(index, time.perf_counter() - t0)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    kinds = ", ".join(f"{k} {v}" for k, v in summary["by_kind"].items())
    typer.echo(f"wrote {summary['studies']} {split} studies ({kinds}); {summary['files']} files in "
               f"{summary['seconds']:.1f} s -> {index}")
