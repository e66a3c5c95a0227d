"""Frame skipping for video, side by side in one run: the model's full 8 frames per clip vs half of them.

The seed claims 30 -> 15 fps cut power by 19% at peak hours. Here: the default model's x1 bundle (energy from the
X1 cost model, `emulated:x1`) and its cpu bundle (this machine's best meter; without a sensor, the CPU-time
estimate `estimated:cpu-time-ccf-aws`), each on the video clips of the test split (cine loops as MP4, decoded
with PyAV), at the default `video_max_frames` (the model sees its 8 frames) and at half (`video_max_frames = 4`,
what a `[policy]` point with that knob makes edgekitd do). Per video report: energy, latency, finding F1 on the
clips with its 95% interval; the DICOM studies are run too, to show they are untouched.

    python bench/frame_skip.py                 # 60 studies of the test split: 15 clips
    python bench/frame_skip.py --limit 240     # all 60 clips
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from edgekit.eval.runner import default_test_split, evaluate
from edgekit.ingest import IngestLimits
from edgekit.pareto.energy import open_meter
from edgekit.reporter import Reporter

sys.path.insert(0, str(Path(__file__).parent))
from pareto_front import fresh_bundle  # noqa: E402

BUNDLES = {"x1": ("x1-int4", None), "cpu": ("cpu-fp32", None)}  # the targets' default builds


def measure(bundle: Path, data: Path, limit: int, frames: int | None, meter) -> dict:
    limits = IngestLimits(video_max_frames=frames) if frames else None
    reporter = Reporter.from_bundle(bundle, limits=limits, meter=meter)
    reporter.warm()
    result = evaluate(reporter, data, limit=limit, include_video=True)
    count = reporter.preprocess_config.num_frames
    videos = [r for r in result["records"] if r["source"] == "video" and r.get("error") is None]
    if not videos:
        raise SystemExit(f"no video clip among the first {limit} studies of {data}")
    f1 = result["video"]["finding_f1"]
    return {
        "video_max_frames": frames,
        "model_frames": min(count, frames) if frames else count,
        "clips": len(videos),
        "failed": result["video"]["failed"],
        "video_f1": f1["value"],
        "video_f1_ci": list(f1["ci95"]),
        "energy_j_per_video": float(np.mean([r["energy_j"] for r in videos])),
        "energy_source": videos[0]["energy_source"],
        "encode_mj_per_video": float(np.mean([r["cost"]["phases"]["encode"]["mj"] for r in videos]))
        if videos[0].get("cost", {}).get("phases")
        else None,
        "latency_ms_per_video": float(np.mean([r["cost"].get("latency_ms", r["timings"]["total_ms"]) for r in videos])),
        "latency_source": videos[0]["cost"].get("figure_source", "measured:wall-clock"),
        "new_tokens_per_video": float(np.mean([r["timings"]["new_tokens"] for r in videos])),
        "dicom_f1": result["overall"]["finding_f1"]["value"],
        "dicom_n": result["overall"]["n"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=60, help="studies of the test split (a quarter carry a clip)")
    ap.add_argument("--half", type=int, default=4, help="video_max_frames of the skipping run")
    ap.add_argument("--cache", type=Path, default=Path("out/pareto-bundles"))
    ap.add_argument("--targets", nargs="+", default=list(BUNDLES))
    ap.add_argument("--json", type=Path, default=Path("out/frame_skip.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    data = default_test_split()
    meter = open_meter("auto")  # cpu reports only: the x1 emulates its own energy, which wins over a meter
    rows = {}
    for target in args.targets:
        name, recipe = BUNDLES[target]
        bundle = fresh_bundle(target, args.cache / f"radreport-tiny-{name}", recipe)
        rows[target] = {"full": measure(bundle, data, args.limit, None, meter)}
        rows[target]["half"] = measure(bundle, data, args.limit, args.half, meter)
        full, half = rows[target]["full"], rows[target]["half"]
        rows[target]["energy_ratio"] = half["energy_j_per_video"] / full["energy_j_per_video"]
        rows[target]["video_f1_change_pt"] = 100 * (half["video_f1"] - full["video_f1"])
        rows[target]["dicom_f1_change_pt"] = 100 * (half["dicom_f1"] - full["dicom_f1"])

    table = Table(title=f"Frame skipping on the test split's video clips (first {args.limit} studies)")
    for col in ("target", "frames", "clips", "video F1 [95% CI]", "J/video", "energy src", "ms/video", "tokens",
                "J vs full", "DICOM F1"):  # fmt: skip
        table.add_column(col)
    for target, r in rows.items():
        for key in ("full", "half"):
            m = r[key]
            lo, hi = m["video_f1_ci"]
            table.add_row(
                target, str(m["model_frames"]), str(m["clips"]), f"{m['video_f1']:.3f} [{lo:.3f}, {hi:.3f}]",
                f"{m['energy_j_per_video']:.4g}", m["energy_source"], f"{m['latency_ms_per_video']:.3g}",
                f"{m['new_tokens_per_video']:.1f}", f"{r['energy_ratio']:.3f}x" if key == "half" else "1",
                f"{m['dicom_f1']:.3f}",
            )  # fmt: skip
    Console(width=170).print(table)
    out = {
        "split": {"name": "test", "studies": args.limit, "data": str(data)},
        "half_video_max_frames": args.half,
        "targets": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
        "note": "x1 energy and latency: the X1 cost model (emulated:x1; host decode not in it); cpu energy: the "
        "CPU-time estimate unless this machine has a sensor; DICOM studies are not frame-skipped",
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    for target, r in rows.items():
        print(
            f"{target}: half the frames {r['energy_ratio']:.3f}x the energy per video report, "
            f"video F1 {r['video_f1_change_pt']:+.1f} pt, DICOM F1 {r['dicom_f1_change_pt']:+.1f} pt"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
