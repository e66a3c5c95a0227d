"""The x1 target against ONNX Runtime on the very same INT4 graphs, side by side in one run.

An x1 bundle carries the INT4 ONNX graphs its programs were compiled from. This script writes every test-split
report twice — once on the X1 emulator (integer numerics: INT8 activations, INT4 KV cache) and once with ONNX
Runtime on those graphs — and reports how many greedy reports are identical, the finding F1 of each (95% CI) and
the difference in points, plus the emulated time and energy per report and the wall-time ratio.

    python bench/x1_parity.py [--bundle out/radreport-tiny-x1] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from edgekit.bundle import load_bundle
from edgekit.eval.runner import default_test_split, evaluate
from edgekit.reporter import Reporter
from edgekit.targets.cpu import CpuBackend
from edgekit.targets.x1.engine import SparseConfig, X1Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, default=None, help="x1 bundle (default: build the default model)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads (the emulator runs on one)")
    ap.add_argument("--out", type=Path, default=Path("bench/x1_parity.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgekit-x1-parity-") as tmp:
        path = a.bundle
        if path is None:
            from edgekit.build import build

            t0 = time.perf_counter()
            path = build("x1", Path(tmp) / "x1", parity=False).bundle
            print(f"built the x1 bundle in {time.perf_counter() - t0:.1f} s", flush=True)
        bundle = load_bundle(path)
        data = default_test_split()
        x1 = X1Engine(path, SparseConfig(enable_sparsity=False))  # dense: the numerics alone are compared
        cpu = Reporter(
            bundle,
            backend=CpuBackend(
                bundle.component("vision_encoder"),
                bundle.component("embed_tokens"),
                bundle.component("decoder"),
                intra_op_threads=a.threads,
            ),
        )
        results = {}
        for name, rep in (("x1 emulator", x1), ("ORT, same INT4 graphs", cpu)):
            t0 = time.perf_counter()
            results[name] = evaluate(rep, data, limit=a.limit, include_video=True)
            results[name]["wall"] = time.perf_counter() - t0
    (xr, cr) = results["x1 emulator"], results["ORT, same INT4 graphs"]
    pairs = list(zip(xr["records"], cr["records"]))
    same = sum(1 for x, c in pairs if x.get("text") == c.get("text"))
    xe = [r["cost"] for r in xr["records"] if r.get("cost")]
    doc = {
        "reports": len(pairs),
        "identical_greedy_reports": same,
        "identical_share": same / len(pairs),
        "finding_f1": {k: v["overall"]["finding_f1"] for k, v in results.items()},
        "f1_delta_points": 100 * (xr["overall"]["finding_f1"]["value"] - cr["overall"]["finding_f1"]["value"]),
        "bleu4": {k: v["overall"]["bleu4"]["value"] for k, v in results.items()},
        "video_f1": {k: (v["video"] or {}).get("finding_f1") for k, v in results.items()},
        "wall_s": {k: v["wall"] for k, v in results.items()},
        "wall_ratio": xr["wall"] / cr["wall"],
        "emulated_per_report": {
            "ms": sum(e.get("emulated_ms_total", 0.0) for e in xe) / max(1, len(xe)),
            "mJ": sum(e.get("mj_total", 0.0) for e in xe) / max(1, len(xe)),
        },
        "source": "edgekit eval on the synthetic test split (DICOM + cine MP4), greedy; F1 95% bootstrap CI; "
        "emulated time/energy from the X1 emulator's cycle and energy model (x1-default machine)",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2))
    print(f"{'':28s} {'finding F1 [95% CI]':28s} {'BLEU-4':>7s} {'wall s':>7s}")
    for k, v in results.items():
        f = v["overall"]["finding_f1"]
        print(
            f"{k:28s} {f['value']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]{'':9s} "
            f"{v['overall']['bleu4']['value']:7.1f} {v['wall']:7.1f}"
        )
    print(
        f"identical greedy reports: {same}/{len(pairs)}; F1 delta {doc['f1_delta_points']:+.2f} points; "
        f"x1/ORT wall {doc['wall_ratio']:.2f}x; emulated {doc['emulated_per_report']['ms']:.3f} ms, "
        f"{doc['emulated_per_report']['mJ']:.3f} mJ per report"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
