"""edgekitd under load over its Unix socket vs the same generation in-process, side by side in one run.

Latency p50/p95/p99 and throughput at concurrency 1, 4 and 16 (synchronous POST /v1/reports of one DICOM file),
and the daemon's overhead at concurrency 1: p50(daemon) / p50(in-process Reporter.report on the same bundle and
file) - 1. Both sides use one ONNX Runtime thread and one model worker. Prints a table, writes JSON.

    python bench/daemon_load.py [--model-dir DIR] [--requests 30] [--out bench/daemon_load.json]

Without --model-dir it serves the trained default weights when they exist, else a tiny random-weights model
with radreport-tiny's architecture and random weights, 96 new tokens per report (`--tiny`: a much smaller
model, the worst case for the ratio since the daemon's fixed cost is then most of the time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edgekit.daemon.client import study_files
from edgekit.daemon.testing import DaemonProcess, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "models" / "samples" / "cr_chest" / "image.dcm"


def stats(latencies_s: list[float], wall_s: float) -> dict:
    ms = np.asarray(latencies_s) * 1e3
    return {"n": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()),
            "throughput_rps": len(ms) / wall_s}


def in_process(bundle: Path, n: int) -> dict:
    from edgekit.reporter import Reporter

    reporter = Reporter.from_bundle(bundle, threads=1)
    for _ in range(3):
        reporter.report(STUDY)
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        reporter.report(STUDY)
        lat.append(time.perf_counter() - t)
    return stats(lat, time.perf_counter() - t0)


def over_socket(d: DaemonProcess, n: int, concurrency: int) -> dict:
    files = study_files(STUDY)

    def one(_):
        t = time.perf_counter()
        r = d.client.post_study("/v1/reports", files)
        return time.perf_counter() - t, r.status

    for _ in range(3):
        one(0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    out = stats([lat for lat, _ in results], wall)
    out["statuses"] = {str(s): sum(1 for _, x in results if x == s) for s in {x for _, x in results}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="the small test architecture instead of radreport-tiny's")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "daemon_load.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgekitd-bench-") as tmp:
        tmp = Path(tmp)
        from edgekit.build import default_model_dir

        model = args.model_dir or (default_model_dir() if (default_model_dir() / "model.safetensors").is_file()
                                   else write_tiny_model(tmp / "random", full_size=not args.tiny, max_new_tokens=96))
        d = DaemonProcess(tmp / "state", model, extra_args=["--max-queue", "64"]).start(wait_ready=600)
        try:
            rows = {"in-process c=1": in_process(tmp / "state" / "bundles" / "default-cpu", args.requests)}
            for c in (1, 4, 16):
                rows[f"daemon c={c}"] = over_socket(d, args.requests * (1 if c == 1 else 2), c)
        finally:
            d.stop()
    base = rows["in-process c=1"]["p50_ms"]
    overhead = rows["daemon c=1"]["p50_ms"] / base - 1
    result = {"model": str(model.name), "study": STUDY.name, "threads": 1, "workers": 1, "rows": rows,
              "overhead_c1_p50": overhead,
              "overhead_c1_mean": rows["daemon c=1"]["mean_ms"] / rows["in-process c=1"]["mean_ms"] - 1}
    print(f"{'mode':<16}{'n':>5}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'req/s':>9}{'x in-proc p50':>15}")
    for name, r in rows.items():
        print(f"{name:<16}{r['n']:>5}{r['p50_ms']:>10.1f}{r['p95_ms']:>10.1f}{r['p99_ms']:>10.1f}"
              f"{r['throughput_rps']:>9.2f}{r['p50_ms'] / base:>15.2f}")
    print(f"daemon overhead at concurrency 1: {overhead * 100:+.1f}% (p50), "
          f"{result['overhead_c1_mean'] * 100:+.1f}% (mean); model {result['model']}")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
