"""LoRA merge, side by side: edgekit (ONNX in, ONNX out, no torch) vs PEFT `merge_and_unload` + export.

    python bench/lora_merge.py [--out bench/results/lora_merge.json] [--rank 16]

On the default radreport-tiny shape (random weights) with a real PEFT adapter on every decoder linear: time of
each path, the largest weight difference between them, logits difference through ONNX Runtime, and how long it
takes to refuse a mismatched adapter (and that nothing was written). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edgekit.export import export_model
from edgekit.export.default import DECODER
from edgekit.export.model_config import ModelConfig
from edgekit.passes.lora import merge_lora
from edgekit.passes.peft_adapter import AdapterError

TARGETS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora_merge.json"))
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()

    import peft
    import torch

    from edgekit.models.radreport_tiny.modeling import RadReportTiny
    from edgekit.targets.cpu import CpuBackend

    torch.set_num_threads(2)
    cfg = ModelConfig()
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    try:
        torch.manual_seed(0)
        base = RadReportTiny(cfg).eval()
        base_w = {k: v.detach().numpy().copy() for k, v in base.state_dict().items()}
        export_model(base_w, cfg, work / "base")
        pm = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        pm.save_pretrained(str(work / "adapter"))

        # PEFT path: load base + adapter, merge, export
        t = time.perf_counter()
        torch.manual_seed(0)
        ref = peft.PeftModel.from_pretrained(RadReportTiny(cfg).eval(), str(work / "adapter")).merge_and_unload()
        ref_w = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
        export_model(ref_w, cfg, work / "peft", check=False)
        peft_s = time.perf_counter() - t

        t = time.perf_counter()
        merged = merge_lora(work / "base", work / "edgekit", [work / "adapter"])
        edgekit_s = time.perf_counter() - t

        inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(work / "edgekit" / DECODER)).graph.initializer}
        weight_err = max(float(np.abs(inits[k] - ref_w[k]).max()) for k in inits)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 24, cfg.hidden)).astype(np.float32)
        mask, pos = np.ones((1, 24), np.int64), np.arange(24)[None]
        la = CpuBackend.from_dir(work / "edgekit").decode(x, mask, pos, None)[0]
        lb = CpuBackend.from_dir(work / "peft").decode(x, mask, pos, None)[0]
        logits_err = float(np.abs(la - lb).max())

        # a mismatched adapter: the same files against a model with another intermediate size
        other = ModelConfig(intermediate=cfg.intermediate + 64)
        from edgekit.export import random_weights

        export_model(random_weights(other, 0), other, work / "other", check=False)
        t = time.perf_counter()
        try:
            merge_lora(work / "other", work / "refused", [work / "adapter"])
            refused, problems = False, 0
        except AdapterError as err:
            refused, problems = True, len(err.problems)
        refuse_s = time.perf_counter() - t
        result = {
            "config": "radreport-tiny default shape, random weights",
            "rank": args.rank,
            "modules": sum(len(v) for v in merged.values()),
            "edgekit_seconds": round(edgekit_s, 3),
            "peft_seconds": round(peft_s, 3),
            "speed_ratio_peft_over_edgekit": round(peft_s / edgekit_s, 2),
            "max_weight_abs_diff": weight_err,
            "max_logits_abs_diff": logits_err,
            "mismatch_refused": refused,
            "mismatch_problems_listed": problems,
            "mismatch_output_written": (work / "refused").exists(),
            "refuse_seconds": round(refuse_s, 3),
            "source": "bench/lora_merge.py, one run, 2 CPU threads",
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        ("path", "seconds"),
        ("edgekit merge_lora (no torch)", result["edgekit_seconds"]),
        ("PEFT merge_and_unload + export", result["peft_seconds"]),
    ]
    for a, b in rows:
        print(f"{a:<34} {b}")
    print(
        f"ratio PEFT/edgekit {result['speed_ratio_peft_over_edgekit']}x; max |dW| {weight_err:.2e}; "
        f"max |dlogits| {logits_err:.2e}; mismatch refused={refused} with {problems} modules listed, "
        f"output written={result['mismatch_output_written']}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
