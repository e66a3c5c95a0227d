"""The orin bundle against the cpu bundle, per variant, side by side in one run: the done-when measurement of the
orin build where there is no Jetson.

For the default model and each recipe asked for, both bundles are built from the same weights; every report of
the test split (240 DICOM studies and 60 cine videos: 300 reports) is written twice, greedy: once by the cpu bundle
(its graphs in ONNX Runtime, the cpu encodings: MatMulNBits, GatherBlockQuantized) and once by the orin bundle's
graphs in ONNX Runtime on cpu (`OrinOnnxBackend`: the strongly typed FP16 graphs with blocked DequantizeLinear that
TensorRT would build from, refusing what the engines' profiles would). Reported: identical greedy reports (share),
finding F1 of each with its 95% CI and the difference in points, BLEU-4, wall time. Pass: >= 95% identical and
|F1 delta| <= 1 point. TensorRT is not run: what it would add on top is the engine check's job on a device.

    python bench/orin_parity.py [--recipes default,int4-orin | all] [--limit N] [--out bench/orin_parity.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from edgekit.build import build
from edgekit.bundle import load_bundle
from edgekit.eval.runner import default_test_split, evaluate
from edgekit.plugins import get_model_family
from edgekit.reporter import Reporter
from edgekit.targets.orin.onnx_backend import OrinOnnxBackend
from edgekit.targets.orin.trt_import import tensorrt_available

IDENTICAL_FLOOR, F1_POINTS = 0.95, 1.0


def run_variant(recipe: str | None, tmp: Path, data: Path, limit: int | None, threads: int) -> dict:
    name = recipe or "default"
    cpu_b = load_bundle(build("cpu", tmp / f"cpu-{name}", parity=False, recipe=recipe).bundle)
    orin_b = load_bundle(build("orin", tmp / f"orin-{name}", parity=False, recipe=recipe).bundle)
    results = {}
    for label, reporter in (
        ("cpu", Reporter(cpu_b, threads=threads)),
        ("orin (ORT)", Reporter(orin_b, backend=OrinOnnxBackend(orin_b, intra_op_threads=threads))),
    ):
        t0 = time.perf_counter()
        results[label] = evaluate(reporter, data, limit=limit, include_video=True)
        results[label]["wall"] = time.perf_counter() - t0
    cpu, orin = results["cpu"], results["orin (ORT)"]
    pairs = list(zip(cpu["records"], orin["records"]))
    same = sum(1 for c, o in pairs if c.get("error") is None and c.get("text") == o.get("text"))
    f1 = {k: v["overall"]["finding_f1"] for k, v in results.items()}
    delta = 100 * (f1["orin (ORT)"]["value"] - f1["cpu"]["value"])
    return {
        "variant": name,
        "reports": len(pairs),
        "identical_greedy_reports": same,
        "identical_share": same / max(1, len(pairs)),
        "finding_f1": f1,
        "f1_delta_points": delta,
        "bleu4": {k: v["overall"]["bleu4"]["value"] for k, v in results.items()},
        "failed": {k: sum(1 for r in v["records"] if r.get("error")) for k, v in results.items()},
        "wall_s": {k: round(v["wall"], 1) for k, v in results.items()},
        "orin_parity_figure": orin_b.manifest.figures["orin_parity"],
        "passed": bool(same / max(1, len(pairs)) >= IDENTICAL_FLOOR and abs(delta) <= F1_POINTS),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="all", help="comma-separated: default and/or recipe names, or all")
    ap.add_argument("--limit", type=int, default=None, help="first N studies (default: the whole split)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/orin_parity.json"))
    a = ap.parse_args()
    recipes = ["default", *get_model_family().recipe_names()] if a.recipes == "all" else a.recipes.split(",")
    data = default_test_split()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgekit-orin-parity-") as tmp:
        for r in recipes:
            t0 = time.perf_counter()
            rows.append(run_variant(None if r == "default" else r, Path(tmp), data, a.limit, a.threads))
            print(f"{r}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    doc = {
        "variants": rows,
        "criterion": f">= {IDENTICAL_FLOOR:.0%} identical greedy reports and |finding F1 delta| <= {F1_POINTS} point",
        "tensorrt_run": tensorrt_available(),
        "source": f"edgekit eval on {data.name} (240 DICOM + 60 cine MP4 = 300 reports unless --limit), greedy; "
        "finding F1 with 95% bootstrap CI; the orin bundle's graphs in ONNX Runtime CPU (OrinOnnxBackend), "
        "not TensorRT",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2))
    head = f"{'variant':15s} {'identical':>10s} {'F1 cpu [95% CI]':>24s} {'F1 orin [95% CI]':>24s} {'dF1 pt':>7s}"
    print(head + f" {'BLEU cpu/orin':>14s} {'wall s cpu/orin':>16s} {'pass':>5s}")
    for row in rows:
        c, o = row["finding_f1"]["cpu"], row["finding_f1"]["orin (ORT)"]
        print(
            f"{row['variant']:15s} {row['identical_greedy_reports']:>4d}/{row['reports']:<5d}"
            f" {c['value']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]{'':4s}"
            f" {o['value']:.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}]{'':4s}"
            f" {row['f1_delta_points']:+7.2f} {row['bleu4']['cpu']:6.1f}/{row['bleu4']['orin (ORT)']:<6.1f}"
            f" {row['wall_s']['cpu']:7.1f}/{row['wall_s']['orin (ORT)']:<7.1f} {'yes' if row['passed'] else 'NO':>5s}"
        )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
