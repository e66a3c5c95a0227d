"""edgekitd's ONNX Runtime threads beside its ingest processes and HTTP server, side by side in one run: ONNX
Runtime's defaults as edgekitd used them before (a thread per physical core, pool threads spinning between runs),
the same threads with spinning stopped at the end of each run (`session.force_spinning_stop`), and edgekitd's
default now (half the physical cores, not spinning: `daemon/cpu_share.py`).

Each configuration is a daemon serving the trained default model over its Unix socket: `--requests` reports at
concurrency 1, then twice as many at 8 (each after 3 to warm up: `bench/daemon_load.py`'s `over_socket`), the
configurations alternated `--rounds` times. Per row: p50 / p95 ms and req/s, and the CPU the daemon and its ingest
processes spent per report. Prints a table, writes JSON.

    python bench/daemon_threads.py [--requests 60] [--rounds 2] [--out bench/daemon_threads.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgekit.daemon.testing import DaemonProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_load import over_socket  # noqa: E402 - a bench beside this one: serving and its figures


def serve(d: DaemonProcess, concurrency: int, n: int) -> dict:
    row = over_socket(d, n, concurrency)
    if row["statuses"] != {"200": n}:
        raise SystemExit(f"reports failed: {row['statuses']}")
    row["daemon_cpu_ms_per_report"] = row["cpu_ms_per_report"]["daemon"] + row["cpu_ms_per_report"]["ingest"]
    return row


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
                    root / "state",
                    default_model_dir(),
                    config=root / "edgekitd.toml",
                    extra_args=["--max-queue", "64", *extra],
                    threads=None,
                )
                with d.start(wait_ready=600):
                    row = {"c=1": serve(d, 1, args.requests), "c=8": serve(d, 8, args.requests * 2)}
                    row["plan"] = d.cpu_plan()
                runs[name].append(row)
    head = f"{'c=1 p50/p95 ms':>18}{'req/s':>8}{'c=8 p50/p95 ms':>18}{'req/s':>8}{'CPU ms c=8':>12}"
    print(f"{'configuration':<44}{head}")
    for name, rows in runs.items():
        for row in rows:
            a, b = row["c=1"], row["c=8"]
            print(
                f"{name:<44}{a['p50_ms']:>9.1f}/{a['p95_ms']:<8.1f}{a['throughput_rps']:>8.1f}"
                f"{b['p50_ms']:>9.1f}/{b['p95_ms']:<8.1f}{b['throughput_rps']:>8.1f}{b['daemon_cpu_ms_per_report']:>12.1f}"
            )
    before, now = (runs[k] for k in (next(iter(configs)), "edgekitd's default now"))
    ratios = {
        "c1_p50_before_over_now": float(np.median([x["c=1"]["p50_ms"] for x in before]))
        / float(np.median([x["c=1"]["p50_ms"] for x in now])),
        "c8_rps_now_over_before": float(np.median([x["c=8"]["throughput_rps"] for x in now]))
        / float(np.median([x["c=8"]["throughput_rps"] for x in before])),
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
