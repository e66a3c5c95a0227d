"""`edgekit build`: weights in, a verified bundle for one target out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.common import JsonOption, emit, err_console

app = typer.Typer(
    help="Build a deployable bundle for a target.",
    epilog=(
        "Examples:\n\n"
        "  edgekit build --target cpu -o out/radreport-tiny-cpu          # the embedded default model\n\n"
        "  edgekit build runs/my-model --target cpu -o out/my.ekb --archive\n\n"
        "  edgekit build --target cpu --recipe int4-awq -o out/radreport-tiny-int4\n\n"
        "  edgekit build --target x1 -o out/radreport-tiny-x1\n\n"
        "  edgekit build --target cpu -o out/b --eval out/test-split --json"
    ),
)


@app.command()
def build(
    model: Annotated[
        Path | None, typer.Argument(help="Model directory (model.safetensors, config.json, tokenizer.json, ...). "
                                         "Default: the embedded radreport-tiny.", show_default=False)
    ] = None,
    target: Annotated[str, typer.Option("--target", "-t", help="cpu (ONNX Runtime) or x1 (the emulated NPU).")] = "cpu",
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle directory, or .ekb file with --archive.")] = Path(
        "out/bundle"),
    archive: Annotated[bool, typer.Option("--archive", help="Write one .ekb file instead of a directory.")] = False,
    name: Annotated[str | None, typer.Option(help="Model name stamped into the manifest.")] = None,
    recipe: Annotated[str | None, typer.Option(help="Passes to apply first: a recipe TOML or a bundled recipe "
                                               "name (fp16, int8, int4, int4-awq, int4-heads38, int4-sparse24).")] = None,
    machine: Annotated[Path | None, typer.Option(help="X1 machine description (default: x1-default).")] = None,
    parity: Annotated[bool, typer.Option(help="Measure ONNX-vs-PyTorch parity (needs the train extra).")] = True,
    eval_data: Annotated[Path | None, typer.Option("--eval", help="Evaluate on this split (from `edgekit data "
                                                    "synth`) and stamp the quality into the manifest.")] = None,
    eval_limit: Annotated[int | None, typer.Option(help="Evaluate only the first N studies.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Export the model's graphs, check them, and write a bundle with provenance and measured figures."""
    from edgekit.build import build as run_build

    def say(msg: str) -> None:
        if not as_json:
            err_console.print(f"[dim]{msg}[/dim]")

    result = run_build(target, out, model_dir=model, name=name, archive=archive, parity=parity,
                       eval_data=eval_data, eval_limit=eval_limit, progress=say, recipe=recipe, machine=machine)
    emit({"bundle": str(result.bundle), "target": target, "figures": result.figures}, as_json)
