"""edgekitd's ONNX Runtime threads beside its ingest processes and HTTP server, side by side in one run: ONNX
Runtime's defaults as edgekitd used them before (a thread per physical core, pool threads spinning between runs),
the same threads with spinning stopped at the end of each run (`session.force_spinning_stop`), and edgekitd's
default now (half the physical cores, not spinning: `daemon/cpu_share.py`).

Each configuration is a daemon serving the trained default model over its Unix socket: `--requests` reports at
concurrency 1, then twice as many at 8 (after 4 to warm up), the configurations alternated `--rounds` times. Per
row: p50 / p95 ms and req/s, and the CPU the daemon and its ingest processes spent per report. Prints a table,
writes JSON.

    python bench/daemon_threads.py [--requests 60] [--rounds 2] [--out bench/daemon_threads.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edgekit.daemon.client import study_files
from edgekit.daemon.testing import DaemonProcess, process_tree

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "models" / "samples" / "cr_chest" / "image.dcm"


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks of 10 ms
    return total


def serve(d: DaemonProcess, concurrency: int, n: int) -> dict:
    files = study_files(STUDY)

    def one(_) -> float:
        t = time.perf_counter()
        if d.client.post_study("/v1/reports", files, timeout=600).status != 200:
            raise SystemExit("a report failed")
        return time.perf_counter() - t

    for _ in range(4):
        one(0)
    pids = process_tree(d.proc.pid)
    cpu0, t0 = cpu_s(pids), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        lat = np.asarray(list(pool.map(one, range(n)))) * 1e3
    wall, cpu1 = time.perf_counter() - t0, cpu_s(pids)
    return {
        "n": n,
        "p50_ms": float(np.percentile(lat, 50)),
        "p95_ms": float(np.percentile(lat, 95)),
        "req_per_s": n / wall,
        "cpu_ms_per_report": (cpu1 - cpu0) / n * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    args = ap.parse_args()
    from edgekit.build import default_model_dir
    from edgekit.ort import physical_cores

    cores = physical_cores()
    configs = {  # name: (edgekitd arguments, [daemon] settings)
        f"ORT defaults: {cores} threads, spinning (before)": (["--threads", str(cores)], "ort_spinning = true"),
        f"{cores} threads, not spinning": (["--threads", str(cores)], ""),
        "edgekitd's default now": ([], ""),
    }
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="edgekitd-threads-") as tmp:
        for r in range(args.rounds):
            for i, (name, (extra, setting)) in enumerate(configs.items() if r % 2 == 0 else reversed(configs.items())):
                root = Path(tmp) / f"{r}-{i}"
                root.mkdir()
                (root / "edgekitd.toml").write_text(f"[daemon]\n{setting}\n")
                d = DaemonProcess(
                    root / "state", default_model_dir(), config=root / "edgekitd.toml", extra_args=["--max-queue", "64"]
                )
                argv = [a for j, a in enumerate(d.args) if "--threads" not in d.args[j - 1 : j + 1]] + extra
                with d.start(args=argv, wait_ready=600):
                    row = {"c=1": serve(d, 1, args.requests), "c=8": serve(d, 8, args.requests * 2)}
                    row["plan"] = next(
                        (x.split("CPUs: ", 1)[1] for x in d.log.read_text().splitlines() if "CPUs: " in x), ""
                    )
                runs[name].append(row)
    head = f"{'c=1 p50/p95 ms':>18}{'req/s':>8}{'c=8 p50/p95 ms':>18}{'req/s':>8}{'CPU ms c=8':>12}"
    print(f"{'configuration':<44}{head}")
    for name, rows in runs.items():
        for row in rows:
            a, b = row["c=1"], row["c=8"]
            print(
                f"{name:<44}{a['p50_ms']:>9.1f}/{a['p95_ms']:<8.1f}{a['req_per_s']:>8.1f}"
                f"{b['p50_ms']:>9.1f}/{b['p95_ms']:<8.1f}{b['req_per_s']:>8.1f}{b['cpu_ms_per_report']:>12.1f}"
            )
    before, now = (runs[k] for k in (next(iter(configs)), "edgekitd's default now"))
    ratios = {
        "c1_p50_before_over_now": float(np.median([x["c=1"]["p50_ms"] for x in before]))
        / float(np.median([x["c=1"]["p50_ms"] for x in now])),
        "c8_rps_now_over_before": float(np.median([x["c=8"]["req_per_s"] for x in now]))
        / float(np.median([x["c=8"]["req_per_s"] for x in before])),
    }
    print(
        f"before / now: c=1 p50 {ratios['c1_p50_before_over_now']:.2f}x slower before; "
        f"c=8 req/s now {ratios['c8_rps_now_over_before']:.2f}x before's"
    )
    for name, rows in runs.items():
        print(f"{name}: {rows[0]['plan']}")
    args.out.write_text(json.dumps({"physical_cores": cores, "runs": runs, "ratios": ratios}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
