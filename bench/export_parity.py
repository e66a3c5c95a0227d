"""ONNX export parity on the whole synthetic test split: ONNX Runtime vs the PyTorch reference, same weights.

For every test study (DICOM, and cine MP4s), both backends get the same pixels and prompt; the script reports
the max abs error of image features and prefill logits, and how many greedy reports are token-for-token
identical. Needs the `train` extra (torch).

    python bench/export_parity.py [--limit N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from edgekit.build import default_model_dir
from edgekit.eval.runner import default_test_split, load_split
from edgekit.export import export_default, load_weights
from edgekit.export.default import load_model_config
from edgekit.export.parity import TorchBackend, single_threaded_torch
from edgekit.generate import generate
from edgekit.ingest import load_study
from edgekit.reporter import Reporter
from edgekit.targets.cpu import CpuBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/export_parity.json"))
    a = ap.parse_args()
    model_dir = default_model_dir()
    data = default_test_split()
    studies = load_split(data)[: a.limit]
    with tempfile.TemporaryDirectory() as tmp, single_threaded_torch():
        export_default(model_dir, tmp)
        ort = CpuBackend.from_dir(tmp, intra_op_threads=1)
        ref = TorchBackend(load_weights(model_dir / "model.safetensors"), load_model_config(model_dir / "config.json"))
        from edgekit.build import build

        reporter = Reporter.from_bundle(build("cpu", Path(tmp) / "b", parity=False).bundle, backend=ort)
        opts = reporter.default_options
        img_err = logit_err = logit_peak = 0.0
        same = total = 0
        t0 = time.perf_counter()
        for s in studies:
            for rel in [s["path"]] + ([s["video_path"]] if s.get("video_path") else []):
                study = load_study(data / rel)
                px = reporter.pixel_values(study)
                ids = reporter.prompt_ids(study.modality, s["indication"])
                fi, fr = ort.encode_images(px), ref.encode_images(px)
                img_err = max(img_err, float(np.abs(fi - fr).max()))
                x_o = np.concatenate([fi, ort.embed(ids)], 1)
                x_r = np.concatenate([fr, ref.embed(ids)], 1)
                mask = np.ones(x_o.shape[:2], np.int64)
                pos = np.arange(x_o.shape[1], dtype=np.int64)[None]
                lo, _ = ort.decode(x_o, mask, pos, None)
                lr, _ = ref.decode(x_r, mask, pos, None)
                logit_err = max(logit_err, float(np.abs(lo - lr).max()))
                logit_peak = max(logit_peak, float(np.abs(lr).max()))  # the scale the error is read against
                same += generate(ort, px, ids, opts).token_ids == generate(ref, px, ids, opts).token_ids
                total += 1
        wall = time.perf_counter() - t0
    doc = {
        "reports": total,
        "identical_greedy": same,
        "image_features_max_abs": img_err,
        "prefill_logits_max_abs": logit_err,
        "prefill_logits_max_abs_reference": logit_peak,
        "wall_s": wall,
        "source": "synthetic test split (DICOM + cine MP4), ONNX Runtime CPU vs PyTorch 2.13 CPU, fp32, greedy",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2))
    print(
        f"reports {total}: identical greedy {same}/{total}; image features max abs {img_err:.2e}; "
        f"prefill logits max abs {logit_err:.2e} (largest |logit| {logit_peak:.1f}; {wall:.0f} s)"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
