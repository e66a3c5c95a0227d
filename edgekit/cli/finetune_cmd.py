"""`edgekit finetune`: a LoRA adapter with learned head gates for a Hugging Face decoder or VLM (train extra).

The output is a PEFT adapter directory plus `head_gates.json`: pass it to the `lora` pass (`edgekit optimize
--pass lora:adapters=DIR`, or a recipe's `[[pass]] name = "lora"`), which merges it and folds the gates without
torch; on x1 the bundle's DSS then skips the closed heads at no cost to the reports.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, TypedDict

import typer

from edgekit.cli.options import ForceOption, JsonOption, ThreadsOption, examples, out_option
from edgekit.cli.output import emit, progress

app = typer.Typer(help="Fine-tune a Hugging Face model with LoRA and learned head gates (train extra).")


class _Defaults(TypedDict):
    """The TrainConfig fields the options show; typed per key, so an int option gets an int default."""

    steps: int
    batch_size: int
    lr: float
    r: int
    gate_rate: float
    max_length: int


_D: _Defaults = {  # the library's defaults, shown in --help without importing torch
    "steps": 200,
    "batch_size": 8,
    "lr": 2e-3,
    "r": 16,
    "gate_rate": 0.375,
    "max_length": 256,
}


@app.command(
    epilog=examples(
        "edgekit finetune hf/tiny-llama --data hf/train.jsonl -o out/adapter --steps 20",
        "edgekit finetune hf/tiny-llama --data hf/train.jsonl --eval-data hf/eval.jsonl -o out/adapter "
        "--steps 20 --gate-rate 0.5 --json | jq .gates",
        note='Data is JSON Lines: {"text": ...}, or {"prompt": ..., "completion": ...} (only the completion is '
        'learned), with "image": PATH for a VLM. Then: edgekit convert hf/tiny-llama -o out/onnx && edgekit '
        "optimize out/onnx -o out/merged --pass lora:adapters=out/adapter. --gate-rate 0 is a plain LoRA fine-tune.",
    )
)
def finetune(
    model: Annotated[
        Path, typer.Argument(help="Hugging Face model directory (config.json, safetensors, tokenizer.json).")
    ],
    data: Annotated[Path, typer.Option("--data", help="Training data, JSON Lines.", show_default=False)],
    out: Annotated[Path, out_option("Adapter directory (PEFT format, with head_gates.json).")] = Path("out/adapter"),
    eval_data: Annotated[
        Path | None, typer.Option("--eval-data", help="Held-out JSON Lines: loss and token accuracy before and after.")
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="Optimiser steps.")] = _D["steps"],
    batch_size: Annotated[int, typer.Option(min=1, help="Examples per step.")] = _D["batch_size"],
    lr: Annotated[float, typer.Option(min=0.0, help="Learning rate of the LoRA matrices.")] = _D["lr"],
    rank: Annotated[int, typer.Option("--rank", min=1, help="LoRA rank r (alpha = 2r).")] = _D["r"],
    gate_rate: Annotated[
        float, typer.Option(min=0.0, max=0.95, help="Fraction of decoder heads the gates close (0: plain LoRA).")
    ] = _D["gate_rate"],
    max_length: Annotated[int, typer.Option(min=2, help="Tokens per example; longer ones are cut (and counted).")] = (
        _D["max_length"]
    ),
    seed: Annotated[int, typer.Option(help="Seed of the LoRA init and the example order.")] = 0,
    threads: ThreadsOption = None,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Train a LoRA adapter and head gates on MODEL's decoder; the base weights stay frozen."""
    from edgekit.finetune.trainer import FinetuneOptions
    from edgekit.finetune.trainer import finetune as run

    opts = FinetuneOptions(
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        r=rank,
        alpha=2.0 * rank,
        gate_rate=gate_rate,
        max_length=max_length,
        seed=seed,
        threads=threads or 0,
    )
    if force and out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    with progress("fine-tuning", total=steps, as_json=as_json) as task:
        result = run(
            model,
            data,
            out,
            opts,
            eval_data=eval_data,
            progress=lambda done, total, loss: task.update(completed=done, description=f"loss {loss:.3f}"),
        )
    emit(result, as_json)
