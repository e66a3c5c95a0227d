"""`edgekit convert`: weights to the ONNX graphs the runtimes load — edgekit's own model directories, or a local
Hugging Face directory (LLaMA/Qwen2 decoders, ViT/SigLIP vision encoders, LLaVA/LLaVA-NeXT/Idefics3/SmolVLM
VLMs), told apart by config.json's `model_type`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.options import ForceOption, ImageSizeOption, JsonOption, ModelArgument, examples, out_option
from edgekit.cli.output import emit

app = typer.Typer(help="Convert a trained model to ONNX graphs.")


@app.command(
    epilog=examples(
        "edgekit convert -o out/onnx                       # the embedded radreport-tiny",
        "edgekit convert models/radreport_tiny/weights -o out/onnx --json",
        note="MODEL may also be a local Hugging Face directory (llama, qwen2, vit, siglip; VLMs: llava, llava_next, "
        "idefics3, smolvlm, qwen2_vl, qwen2_5_vl, which give all three graphs), such as ~/models/TinyLlama-1.1B. "
        "Qwen2-VL's dynamic resolution is pinned with --image-size S (e.g. 448 for Qwen2-VL-2B-Instruct).",
    )
)
def convert(
    model: ModelArgument = None,
    out: Annotated[Path, out_option("Folder for the .onnx files.")] = Path("out/onnx"),
    force: ForceOption = False,
    image_size: ImageSizeOption = None,
    as_json: JsonOption = False,
) -> None:
    """Write the ONNX graphs (opset 21) from weights; big weights go to <graph>.onnx.data. MODEL is edgekit's own
    model directory or a Hugging Face one (llama, qwen2, vit, siglip, llava, llava_next, idefics3, smolvlm, qwen2_vl,
    qwen2_5_vl), told apart by config.json's model_type."""
    from edgekit.build import default_model_dir
    from edgekit.hf import convert_hf, is_hf_model_dir

    if model is not None and is_hf_model_dir(model):
        files = convert_hf(model, out, image_size=image_size).graphs
    else:
        from edgekit.export import export_default

        if image_size is not None:
            from edgekit.hf.qwen2_vl_processor import image_size_refused

            raise image_size_refused("edgekit's own model", model or default_model_dir(), "edgekit")

        graphs = export_default(model or default_model_dir(), out)
        files = [graphs.vision_encoder, graphs.embed_tokens, graphs.decoder]
    rows = []
    for p in files:
        data = p.with_name(p.name + ".data")
        rows.append(
            {
                "graph": p.name,
                "bytes": p.stat().st_size + (data.stat().st_size if data.is_file() else 0),
                "path": str(p),
            }
        )
    emit(rows, as_json)
