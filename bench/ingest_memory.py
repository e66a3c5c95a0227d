"""What ingest costs in memory against what it produces: the peak it allocates (tracemalloc, which sees numpy's
buffers) per study, side by side with the study's display array (the float32 frames every caller gets).

A ratio near 1 means decode adds little beyond its output (frame by frame into one array). Each study is loaded in
its own child process, after a small study has imported the decoders: once for the peak, then 3 times for the best
time.
Run it from outside the checkout with PYTHONPATH set to another tree to measure that tree's ingest the same way.

    python bench/ingest_memory.py [--out bench/ingest_memory.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, tracemalloc
from edgekit.ingest import load_study
load_study(sys.argv[2])  # imports pydicom and its decoders, so the peak below is the study's own
tracemalloc.start()  # numpy reports its buffers to tracemalloc: the peak is what ingest allocated, exactly
study = load_study(sys.argv[1])
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
display, frames = study.frames.nbytes, int(study.frames.shape[0])
del study
times = []
for _ in range(3):
    t = time.perf_counter(); load_study(sys.argv[1]); times.append(time.perf_counter() - t)
print(json.dumps({"peak_mib": peak / 2**20, "display_mib": display / 2**20, "best_ms": min(times) * 1e3,
                  "frames": frames}))
"""


def corpus(folder: Path) -> dict[str, Path]:
    """Three studies: the CT sample (a series of small RLE files), a native multi-frame and an RLE multi-frame."""
    import numpy as np
    from pydicom.uid import RLELossless

    sys.path.insert(0, str(REPO / "tests"))
    from ingest_factory import make_dataset, ramp, rle_zero_frames, save

    native = save(make_dataset(np.stack([ramp(256, 256, offset=k) for k in range(200)])), folder / "native.dcm")
    rle = make_dataset(np.zeros((2, 2), np.uint8))
    rle.Rows = rle.Columns = 512
    rle.NumberOfFrames = 300
    rle.PixelData = rle_zero_frames(512, 512, 300)
    rle["PixelData"].VR = "OB"
    return {
        "CT sample, 14 RLE files": REPO / "models" / "samples" / "ct_chest",
        "native multi-frame, 200 x 256^2 16-bit": native,
        "RLE multi-frame, 300 x 512^2": save(rle, folder / "rle.dcm", RLELossless),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "ingest_memory.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        warm_up = REPO / "models" / "samples" / "cr_chest" / "image.dcm"
        for name, path in corpus(Path(tmp)).items():
            command = [sys.executable, "-c", CHILD, str(path), str(warm_up)]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            row = {"study": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            row["peak_per_display"] = row["peak_mib"] / row["display_mib"]
            rows.append(row)
    print(f"{'study':42s} {'frames':>6s} {'display MiB':>11s} {'peak MiB':>9s} {'peak/display':>12s} {'best ms':>8s}")
    for r in rows:
        print(
            f"{r['study']:42s} {r['frames']:6d} {r['display_mib']:11.1f} {r['peak_mib']:9.1f} "
            f"{r['peak_per_display']:12.2f} {r['best_ms']:8.1f}"
        )
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
