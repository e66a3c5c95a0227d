"""`edgekit build`: weights in, a verified bundle for one target out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from edgekit.cli.options import (
    ForceOption,
    ImageSizeOption,
    JsonOption,
    MachineOption,
    ModelArgument,
    examples,
    out_option,
)
from edgekit.cli.output import emit, err_console
from edgekit.plugins import target_names

app = typer.Typer(help="Build a deployable bundle for a target.")


@app.command(
    epilog=examples(
        "edgekit build --target cpu -o out/radreport-tiny-cpu     # the embedded model; parity against PyTorch",
        "edgekit build --target x1 -o out/radreport-tiny-x1 --no-parity          # compiled for the X1 NPU",
        "edgekit build --target orin -o out/radreport-tiny-orin --no-parity      # for TensorRT on a Jetson",
        "edgekit build models/radreport_tiny/weights -o out/radreport-tiny.ekb --archive --no-parity",
        "edgekit build --recipe int4 -o out/radreport-tiny-int4 --no-parity      # or int4-awq, int8, fp16, ...",
        "edgekit build -o out/radreport-tiny-cpu --force --no-parity --eval data/test --eval-limit 4 --json",
        "edgekit bundle keygen -o out/release && edgekit build -o out/signed-cpu --no-parity --sign out/release.key",
        note="--eval takes a split written by edgekit data synth; --force replaces an earlier bundle. MODEL may "
        "also be a local Hugging Face VLM directory (llava, llava_next, idefics3, smolvlm, qwen2_vl, qwen2_5_vl) "
        "such as ~/models/llava-1.5-7b-hf: its tokenizer.json, chat template and image preprocessing go into the "
        "bundle (docs/hf-import.md). A stock Qwen2-VL download (dynamic resolution) builds at the side "
        "--image-size pins (e.g. 448 for Qwen2-VL-2B-Instruct: 256 image tokens). A decoder alone (llama, qwen2, "
        "mistral) becomes a text bundle, served from a prompt: edgekit build ~/models/Qwen2-0.5B-Instruct "
        "--recipe int4 -o out/qwen2-int4, then edgekit run out/qwen2-int4 -p TEXT.",
    )
)
def build(
    model: ModelArgument = None,
    target: Annotated[str, typer.Option("--target", "-t", help=f"One of: {', '.join(target_names())}.")] = "cpu",
    out: Annotated[Path, out_option("Bundle directory, or .ekb file with --archive.")] = Path("out/bundle"),
    force: ForceOption = False,
    archive: Annotated[bool, typer.Option("--archive", help="Write one .ekb file instead of a directory.")] = False,
    name: Annotated[str | None, typer.Option(help="Model name stamped into the manifest.")] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            help="Passes to apply first: a recipe TOML or a bundled recipe "
            "name (fp16, int8, int4, int4-awq, int4-heads38, int4-sparse24)."
        ),
    ] = None,
    machine: MachineOption = None,
    parity: Annotated[bool, typer.Option(help="Measure ONNX-vs-PyTorch parity (needs the train extra).")] = True,
    eval_data: Annotated[
        Path | None,
        typer.Option(
            "--eval", help="Evaluate on this split (from `edgekit data synth`) and stamp the quality into the manifest."
        ),
    ] = None,
    eval_limit: Annotated[int | None, typer.Option(min=1, help="Evaluate only the first N studies.")] = None,
    image_size: ImageSizeOption = None,
    sign: Annotated[
        Path | None,
        typer.Option(
            "--sign",
            help="Sign the bundle with this minisign secret key as it is written (an encrypted key's password: "
            "$EDGEKIT_KEY_PASSWORD).",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Export the model's graphs, check them, and write a bundle with provenance and measured figures."""
    import os

    from edgekit.build import build as run_build
    from edgekit.bundle.minisign import SecretKey
    from edgekit.bundle.signing import sign_bundle

    key = SecretKey.read(sign, os.environ.get("EDGEKIT_KEY_PASSWORD")) if sign else None  # refused before building

    def say(msg: str) -> None:
        if not as_json:
            err_console.print(f"[dim]{escape(msg)}[/dim]")  # a message is text, never markup

    result = run_build(
        target,
        out,
        model_dir=model,
        name=name,
        archive=archive,
        parity=parity,
        eval_data=eval_data,
        eval_limit=eval_limit,
        progress=say,
        recipe=recipe,
        machine=machine,
        image_size=image_size,
    )
    figure = result.figures.get("parity")
    if figure is not None and not figure.get("measured", True):
        say(f"parity: {figure.get('source', 'not measured')}")  # what the manifest says: the step did not run
    out_doc = {"bundle": str(result.bundle), "target": target, "figures": result.figures}
    if key is not None:
        signed = sign_bundle(result.bundle, key)
        out_doc["signature"] = signed.to_dict()
        say(f"signed by key {signed.key_id}")
    emit(out_doc, as_json)
