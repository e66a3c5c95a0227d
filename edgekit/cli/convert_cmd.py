"""`edgekit convert`: weights to the ONNX graphs the runtimes load — edgekit's own model directories, or a local
Hugging Face directory (LLaMA/Qwen2 decoders, ViT/SigLIP vision encoders), told apart by config.json's
`model_type`."""

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
        "  edgekit convert runs/my-model -o out/onnx --json\n\n"
        "  edgekit convert ~/models/TinyLlama-1.1B -o out/tinyllama   # a Hugging Face directory"
    ),
)


@app.command()
def convert(
    model: Annotated[Path | None, typer.Argument(help="Model directory (model.safetensors + config.json), either "
                                                 "edgekit's or a Hugging Face one (llama, qwen2, vit, siglip). "
                                                 "Default: the embedded radreport-tiny.", show_default=False)] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the .onnx files.")] = Path("out/onnx"),
    as_json: JsonOption = False,
) -> None:
    """Write the ONNX graphs (opset 21) from weights; big weights go to <graph>.onnx.data."""
    from edgekit.build import default_model_dir
    from edgekit.hf import convert_hf, is_hf_model_dir

    if model is not None and is_hf_model_dir(model):
        files = convert_hf(model, out).graphs
    else:
        from edgekit.export import export_default

        graphs = export_default(model or default_model_dir(), out)
        files = [graphs.vision_encoder, graphs.embed_tokens, graphs.decoder]
    rows = []
    for p in files:
        data = p.with_name(p.name + ".data")
        rows.append({"graph": p.name, "bytes": p.stat().st_size + (data.stat().st_size if data.is_file() else 0),
                     "path": str(p)})
    emit(rows, as_json)
