"""`edgekit data`: make the synthetic studies radreport-tiny trains and is evaluated on.

Wired into the main CLI as the `data` group (`edgekit data synth -o OUT`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.options import ForceOption, JsonOption, examples, out_option
from edgekit.cli.output import console, emit, progress

app = typer.Typer(
    help="Synthetic DICOM and video studies with ground-truth reports.",
    no_args_is_help=True,
    add_completion=False,
    epilog=examples("edgekit data synth -o data/test --count 8"),
)


@app.callback()
def _data() -> None:
    """Synthetic DICOM and video studies with ground-truth reports."""


@app.command(
    "synth",
    epilog=examples(
        "edgekit data synth -o data/test --count 8",
        "edgekit data synth -o data/train --split train --count 8",
        "edgekit data synth -o data/sample --split sample --count 8 --json",
        note="Writes OUT/studies.jsonl (id, modality, path, findings, negatives, indication, references per study) and "
        "one folder per study: DICOM slices (CT, MR), one image (CR/DX), or a multi-frame cine (US) plus the same "
        "loop as cine.mp4. Every run writes identical studies: each is a pure function of (split, index). "
        "Without --count: 240 studies.",
    ),
)
def synth(
    out: Annotated[
        Path | None,
        out_option(
            "Folder to write. With --force, one holding the same split is rewritten; an unrelated folder never is."
        ),
    ] = None,
    split: Annotated[str, typer.Option("--split", help="train, val, test or sample: independent streams.")] = "test",
    count: Annotated[
        int, typer.Option("--count", min=0, help="Number of studies (kinds rotate CT, MR, CR/DX, US).")
    ] = 240,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Write COUNT synthetic studies of SPLIT into OUT with their ground truth."""
    from edgekit.models.synth.generator import SPLITS
    from edgekit.models.synth.splits import summarize, write_split

    if out is None:
        raise typer.BadParameter("missing: the folder to write the studies to", param_hint="'--out' / '-o'")
    if split not in SPLITS:
        raise typer.BadParameter(f"{split!r} is not one of {', '.join(SPLITS)}", param_hint="'--split'")
    t0 = time.perf_counter()
    with progress(f"synth {split}", total=count, as_json=as_json) as task:
        index = write_split(out, split, count, progress=lambda done, total: task.update(completed=done))
    summary = summarize(index, time.perf_counter() - t0)
    if as_json:
        emit(summary, True)
        return
    kinds = ", ".join(f"{k} {v}" for k, v in summary["by_kind"].items())
    console.print(
        f"wrote {summary['studies']} {split} studies ({kinds}); {summary['files']} files in "
        f"{summary['seconds']:.1f} s -> {index}",
        markup=False,
    )
