"""`edgekit convert`: weights to the three ONNX graphs the runtimes load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.common import JsonOption, emit

app = typer.Typer(
    help="Convert a trained model to ONNX graphs.",
    epilog=(
        "Examples:\n\n"
        "  edgekit convert -o out/onnx                       # the embedded radreport-tiny\n\n"
        "  edgekit convert runs/my-model -o out/onnx --json"
    ),
)


@app.command()
def convert(
    model: Annotated[Path | None, typer.Argument(help="Model directory (model.safetensors + config.json). "
                                                 "Default: the embedded radreport-tiny.", show_default=False)] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the .onnx files.")] = Path("out/onnx"),
    as_json: JsonOption = False,
) -> None:
    """Write vision_encoder.onnx, embed_tokens.onnx and decoder_model_merged.onnx (opset 21) from weights."""
    from edgekit.build import default_model_dir
    from edgekit.export import export_default

    graphs = export_default(model or default_model_dir(), out)
    files = [graphs.vision_encoder, graphs.embed_tokens, graphs.decoder]
    emit([{"graph": p.name, "bytes": p.stat().st_size, "path": str(p)} for p in files], as_json)
