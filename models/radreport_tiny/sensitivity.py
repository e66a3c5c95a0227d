"""The torch step of co-pruning: |dL/dw| and E|a| of every decoder weight, from labelled calibration studies.

    python -m edgekit.models.radreport_tiny.sensitivity --out scores.safetensors [--weights DIR] [--studies 128]

The loss is the training loss's LM term (report tokens and <eos>, teacher-forced) on studies of the train split
the model was trained on. For every decoder Linear y = a W^T: `MODULE.grad_abs` is the mean over batches of
|dL/dW| and `MODULE.act_abs` the mean |a| per input channel over non-padding tokens, both in ONNX's (K, N)
layout, so `edgekit.passes.copruning` reads them against the exported graph's initializers. The file's metadata
says how they were made; the pass copies it into the bundle's provenance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgekit.preprocess import PreprocessConfig

from .data import build_split, encode_split, make_batch
from .determinism import set_determinism, to_torch
from .lora import load_base
from .objectives import lm_loss


def decoder_linears(model) -> dict[str, nn.Linear]:
    named = {f"model.{n}": m for n, m in model.model.named_modules() if isinstance(m, nn.Linear)}
    return {**named, "lm_head": model.lm_head}


def sensitivity(weights_dir: Path, studies: int, batch_size: int = 16, seed: int = 0) -> tuple[dict, dict]:
    """(arrays, metadata): see the module docstring."""
    set_determinism(seed, 2)
    model, tok, _ = load_base(weights_dir)
    data = build_split("train", studies, PreprocessConfig())
    enc = encode_split(tok, data)
    linears = decoder_linears(model)
    grads = {n: torch.zeros_like(m.weight) for n, m in linears.items()}
    act_sum = {n: torch.zeros(m.in_features, dtype=torch.float64) for n, m in linears.items()}
    tokens = {"n": 0}
    keep: dict[str, torch.Tensor] = {}  # the current batch's non-padding mask over the decoder's positions

    def hook(name):
        def record(_module, inputs, _output):
            a = inputs[0].detach()
            m = keep["mask"][..., None].to(a.dtype) if a.shape[:2] == keep["mask"].shape else 1.0
            act_sum[name] += (a.abs() * m).reshape(-1, a.shape[-1]).sum(0).double()

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    model.eval()
    batches = 0
    try:
        for s in range(0, studies, batch_size):
            items = [(i, enc.data.texts[i].modality, 0) for i in range(s, min(studies, s + batch_size))]
            b = to_torch(make_batch(enc, items))
            n_img = model.config.num_image_tokens
            mask = torch.cat([torch.ones(len(items), n_img), b["attention_mask"].float()], dim=1)
            keep["mask"] = mask
            tokens["n"] += int(mask.sum())
            model.zero_grad(set_to_none=True)
            lm_loss(model, b).backward()
            for n, m in linears.items():
                grad = m.weight.grad
                if grad is not None:  # None: the loss does not reach that weight, a zero gradient
                    grads[n] += grad.abs()
            batches += 1
    finally:
        for h in handles:
            h.remove()
    arrays = {}
    for n in linears:
        arrays[f"{n}.grad_abs"] = (grads[n] / batches).T.contiguous().numpy().astype(np.float32)
        arrays[f"{n}.act_abs"] = (act_sum[n] / tokens["n"]).numpy().astype(np.float32)
    meta = {
        "step": "edgekit.models.radreport_tiny.sensitivity",
        "loss": "teacher-forced LM cross-entropy on the reference reports",
        "split": "train",
        "studies": studies,
        "batch_size": batch_size,
        "batches": batches,
        "tokens": tokens["n"],
        "torch": torch.__version__,
        "weights_sha256": hashlib.sha256((weights_dir / "model.safetensors").read_bytes()).hexdigest(),
    }
    return arrays, meta


def main(argv: list[str] | None = None) -> dict:
    from safetensors.numpy import save_file

    from .family import FAMILY

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="scores file to write (.safetensors)")
    ap.add_argument("--weights", type=Path, default=None, help="weights directory (default: the embedded model)")
    ap.add_argument("--studies", type=int, default=128, help="train-split studies to take gradients on")
    a = ap.parse_args(argv)
    if a.studies < 1:
        ap.error("--studies must be >= 1")
    weights = a.weights or FAMILY.weights_dir()
    arrays, meta = sensitivity(weights, a.studies)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(a.out), metadata={"edgekit": json.dumps(meta)})
    print(f"wrote {a.out}: {len(arrays) // 2} weights, {meta['tokens']} tokens of {a.studies} studies", file=sys.stderr)
    return meta


if __name__ == "__main__":
    main()
