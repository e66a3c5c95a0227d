"""edgekitd under load over its Unix socket vs the same generation in-process, side by side in one run.

Latency p50/p95/p99 and throughput at concurrency 1, 4, 8 and 16 (synchronous POST /v1/reports of one DICOM file), with
continuous batching (the default: 8 workers, the token engine's max_batch 8) and, beside it, the same daemon serving one
report at a time (`--workers 1 --max-batch 1`, as before the engine batched), so the ratio c=8 / c=1 is measured against
its own baseline in one run, and the same batched daemon with ingest in its own threads (`--ingest-processes 0`, as
before ingest moved to worker processes) at c=1 and c=8, and with one ingest process (`--ingest-processes 1`, the
default on 2 cores before it became at least two) at c=8. The daemon's overhead at concurrency 1: p50(daemon) / p50(in-
process Reporter.report on the same bundle and file) - 1. Both sides use one ONNX Runtime thread. Then the faults,
counted: `kill -9` with durable jobs accepted and a restart (every accepted job must complete), overload at 4x capacity
(answers must be 2xx or 503 only; the daemon's RSS before/after and its peak; healthy afterwards), and RSS (the daemon's
and its ingest processes', summed) over `--soak` reports at concurrency 8 (sampled every 50; flat means no growth after
the first 100). `--x1` adds the default model's x1 bundle served at c=1 and c=8: emulated latency and energy per report.
Each row over the socket also says where a report's CPU went: the daemon process, its ingest processes, and this
bench's client threads (they share the machine), how many cores were busy, and how long studies waited for an
ingest thread and process (the report's `ingest_wait_ms`, p50/p95). Also the first three reports after the batched
daemon said it was ready (what anything it starts lazily costs a study). Prints tables, writes JSON.

    python bench/daemon_load.py [--model-dir DIR] [--requests 30] [--soak 500] [--x1] [--out bench/daemon_load.json]

Without --model-dir it serves the trained default weights when they exist, else a tiny random-weights model
with radreport-tiny's architecture and random weights, 96 new tokens per report (`--tiny`: a much smaller
model, the worst case for the ratio since the daemon's fixed cost is then most of the time).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edgekit.daemon.client import study_files
from edgekit.daemon.testing import DaemonProcess, proc_kib, process_tree, write_tiny_model
from edgekit.ingest.decode_threads import decode_threads, set_threads

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "models" / "samples" / "cr_chest" / "image.dcm"


def stats(latencies_s: list[float], wall_s: float) -> dict:
    ms = np.asarray(latencies_s) * 1e3
    return {
        "n": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "throughput_rps": len(ms) / wall_s,
    }


def first_reports(d: DaemonProcess, n: int = 3) -> list[float]:
    """Milliseconds of the first `n` reports after the daemon said it was ready, one at a time: what a study pays for
    anything the daemon starts lazily (its ingest processes start with it, beside the model load)."""
    files = study_files(STUDY)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        if d.client.post_study("/v1/reports", files).status != 200:
            raise SystemExit("the first reports after start failed")
        out.append((time.perf_counter() - t) * 1e3)
    return out


def interleaved_c1(d: DaemonProcess, bundle: Path, n: int) -> tuple[dict, dict]:
    """Concurrency 1, side by side: each round one request to the daemon, then the same report in-process, so both
    see the same background load (measured minutes apart on a shared machine, the ratio was mostly noise)."""
    from edgekit.reporter import Reporter

    files = study_files(STUDY)
    reporter = Reporter.from_bundle(bundle, threads=1)
    for _ in range(3):
        reporter.report(STUDY)
        d.client.post_study("/v1/reports", files)
    lat_in, lat_d, split = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        r = d.client.post_study("/v1/reports", files)
        lat_d.append(time.perf_counter() - t)
        split.append(r.json()["timings"])
        t = time.perf_counter()
        reporter.report(STUDY)
        lat_in.append(time.perf_counter() - t)
    inproc, daemon = stats(lat_in, sum(lat_in)), stats(lat_d, sum(lat_d))
    daemon["server_split_p50_ms"] = {
        k: float(np.median([s[k] for s in split])) for k in ("queue_ms", "generate_ms", "total_ms")
    }
    return inproc, daemon


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_now(d: DaemonProcess) -> dict:
    """CPU seconds so far of the daemon process, of its ingest processes (its descendants) and of this bench (the
    clients' threads): on a machine the daemon shares with its clients, where each report's CPU goes."""
    pid = d.proc.pid
    me = os.times()
    return {
        "daemon": cpu_s(pid),
        "ingest": sum(cpu_s(p) for p in process_tree(pid) if p != pid),
        "client": me.user + me.system,
    }


def over_socket(d: DaemonProcess, n: int, concurrency: int) -> dict:
    files = study_files(STUDY)

    def one(_):
        t = time.perf_counter()
        r = d.client.post_study("/v1/reports", files, timeout=600)
        return time.perf_counter() - t, r.status, r.json().get("timings", {}) if r.status == 200 else {}

    for _ in range(3):
        one(0)
    cpu0, t0 = cpu_now(d), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(n)))
    wall, cpu1 = time.perf_counter() - t0, cpu_now(d)
    out = stats([lat for lat, _, _ in results], wall)
    out["cpu_ms_per_report"] = {k: (cpu1[k] - cpu0[k]) / n * 1e3 for k in cpu0}  # an ingest process's restart: 0
    out["cores_busy"] = sum(cpu1[k] - cpu0[k] for k in cpu0) / wall
    out["statuses"] = {str(s): sum(1 for _, x, _ in results if x == s) for s in {x for _, x, _ in results}}
    out["server_split_p50_ms"] = {
        k: float(np.median([t[k] for _, _, t in results if t])) for k in ("queue_ms", "generate_ms", "total_ms")
    }
    waits = [t["ingest_wait_ms"] for _, _, t in results if t and "ingest_wait_ms" in t]
    if waits:  # how long studies queued for an ingest thread and process (where a c=8 tail waits)
        out["ingest_wait_ms"] = {"p50": float(np.percentile(waits, 50)), "p95": float(np.percentile(waits, 95))}
    return out


def soak(d: DaemonProcess, n: int, concurrency: int = 8, every: int = 50) -> dict:
    """`n` reports at `concurrency`; the daemon's RSS every `every` reports (growth after the first 100 = a leak)."""
    files = study_files(STUDY)
    samples, statuses = [], {}
    with ThreadPoolExecutor(concurrency) as pool:
        for start in range(0, n, every):
            for r in pool.map(lambda _: d.client.post_study("/v1/reports", files, timeout=600), range(every)):
                statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
            samples.append({"reports": start + every, **rss_kib(d.proc.pid)})
    settled = [s["rss_kib"] for s in samples if s["reports"] > 100]
    return {
        "reports": n,
        "concurrency": concurrency,
        "statuses": statuses,
        "rss_kib": samples,
        "growth_after_100_mib": (max(settled) - min(settled)) / 1024 if settled else 0.0,
    }


def x1_rows(tmp: Path, model: Path, n: int) -> dict:
    """The default model built for x1 and served as the only variant: c=1 and c=8, with the emulated cost."""
    from edgekit.build import build

    bundle = tmp / "x1-bundle"
    build("x1", bundle, model_dir=model, parity=False)
    config = tmp / "x1.toml"
    config.write_text(f'[[variants]]\nname = "x1"\nbundle = "{bundle}"\n')
    d = DaemonProcess(tmp / "state-x1", config=config, extra_args=["--max-queue", "64"]).start(wait_ready=900)
    files = study_files(STUDY)
    out = {}
    try:
        for c in (1, 8):
            reports = []

            def one(_):
                t = time.perf_counter()
                r = d.client.post_study("/v1/reports", files, timeout=900)
                return time.perf_counter() - t, r.json()

            one(0)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                results = list(pool.map(one, range(n)))
            row = stats([lat for lat, _ in results], time.perf_counter() - t0)
            reports = [rep for _, rep in results]
            row["emulated_ms_per_report"] = float(np.median([r["cost"].get("emulated_ms_total", 0) for r in reports]))
            row["emulated_mj_per_report"] = float(np.median([r["energy_j"] * 1e3 for r in reports]))
            row["energy_source"] = reports[0]["energy_source"]
            out[f"x1 c={c}"] = row
    finally:
        d.stop()
    return out


def rss_kib(pid: int) -> dict:
    """Resident set now and its peak (VmHWM), from /proc: the daemon's and its ingest processes', summed."""
    kib = proc_kib(pid)
    return {"rss_kib": kib["VmRSS"], "peak_kib": kib["VmHWM"]}


def kill9_recovery(state: Path, model: Path, n_jobs: int) -> dict:
    """Accept `n_jobs` durable jobs, SIGKILL the daemon at once, restart on the same state dir, count them done."""
    files = study_files(STUDY)
    d = DaemonProcess(state, model, extra_args=["--max-queue", str(n_jobs)]).start(wait_ready=600)
    ids = []
    for i in range(n_jobs):
        r = d.client.post_study("/v1/jobs", files, {"prompt": f"job {i}"}, headers={"Idempotency-Key": f"k9-{i}"})
        assert r.status == 202, r.body
        ids.append(r.json()["id"])
    done_before = sum(d.client.get(f"/v1/jobs/{j}").json()["state"] == "succeeded" for j in ids)
    d.kill()
    t0 = time.perf_counter()
    d2 = DaemonProcess(state, model).start(wait_ready=600)
    ready_s = time.perf_counter() - t0
    try:
        recovered = d2.client.get("/v2/health/ready").json()["recovered_jobs"]
        deadline = time.monotonic() + 600
        while True:
            states = [d2.client.get(f"/v1/jobs/{j}").json()["state"] for j in ids]
            if all(s in ("succeeded", "failed") for s in states) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        all_done_s = time.perf_counter() - t0
    finally:
        d2.stop()
    return {
        "accepted": n_jobs,
        "finished_before_kill": done_before,
        "recovered_on_restart": recovered,
        "succeeded": states.count("succeeded"),
        "failed": states.count("failed"),
        "lost": n_jobs - states.count("succeeded") - states.count("failed"),
        "restart_to_ready_s": ready_s,
        "restart_to_all_done_s": all_done_s,
    }


def overload(state: Path, model: Path, max_queue: int, waves: int) -> dict:
    """4x capacity (one worker + `max_queue` waiting) at once, `waves` times; statuses, RSS, health after."""
    files = study_files(STUDY)
    capacity = 1 + max_queue
    d = DaemonProcess(state, model, extra_args=["--max-queue", str(max_queue), "--workers", "1"]).start(wait_ready=600)
    try:
        for _ in range(2):
            d.client.post_study("/v1/reports", files)
        before = rss_kib(d.proc.pid)

        def one(_):
            r = d.client.post_study("/v1/reports", files, timeout=600)
            return r.status, r.headers.get("retry-after")

        statuses: dict[str, int] = {}
        t0 = time.perf_counter()
        for _ in range(waves):
            with ThreadPoolExecutor(4 * capacity) as pool:
                for status, _ra in pool.map(one, range(4 * capacity)):
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
        wall = time.perf_counter() - t0
        after = rss_kib(d.proc.pid)
        ready = d.client.get("/v2/health/ready")
        healthy = (
            ready.status == 200
            and ready.json()["queue_depth"] == 0
            and d.client.post_study("/v1/reports", files).status == 200
        )
    finally:
        d.stop()
    return {
        "capacity": capacity,
        "concurrency": 4 * capacity,
        "requests": 4 * capacity * waves,
        "statuses": statuses,
        "only_2xx_503": set(statuses) <= {"200", "503"},
        "wall_s": wall,
        "rss_before_kib": before["rss_kib"],
        "rss_after_kib": after["rss_kib"],
        "rss_peak_kib": after["peak_kib"],
        "healthy_after": healthy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="the small test architecture instead of radreport-tiny's")
    ap.add_argument("--kill9-jobs", type=int, default=12)
    ap.add_argument("--overload-queue", type=int, default=4, help="max_queue of the overload run (capacity - 1)")
    ap.add_argument("--overload-waves", type=int, default=2)
    ap.add_argument("--soak", type=int, default=500, help="reports of the RSS soak (0: skip)")
    ap.add_argument("--x1", action="store_true", help="also serve the x1 bundle (emulated latency and energy)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "daemon_load.json")
    args = ap.parse_args()
    set_threads(decode_threads())  # in-process studies decode as under `edgekit run` (daemons start without it)
    with tempfile.TemporaryDirectory(prefix="edgekitd-bench-") as tmp:
        tmp = Path(tmp)
        from edgekit.build import default_model_dir

        model = args.model_dir or (
            default_model_dir()
            if (default_model_dir() / "model.safetensors").is_file()
            else write_tiny_model(tmp / "random", full_size=not args.tiny, max_new_tokens=96)
        )
        serial = DaemonProcess(
            tmp / "state-serial", model, extra_args=["--max-queue", "64", "--workers", "1", "--max-batch", "1"]
        ).start(wait_ready=600)
        try:
            rows = {"serial c=1": over_socket(serial, args.requests, 1)}
            for c in (8,):
                rows[f"serial c={c}"] = over_socket(serial, args.requests * 2, c)
        finally:
            serial.stop()
        threads = DaemonProcess(
            tmp / "state-threads", model, extra_args=["--max-queue", "64", "--ingest-processes", "0"]
        ).start(wait_ready=600)
        try:
            for c in (1, 8):
                rows[f"threads c={c}"] = over_socket(threads, args.requests * (2 if c > 1 else 1), c)
        finally:
            threads.stop()
        one = DaemonProcess(
            tmp / "state-one", model, extra_args=["--max-queue", "64", "--ingest-processes", "1"]
        ).start(wait_ready=600)
        try:
            rows["one ingest c=8"] = over_socket(one, args.requests * 2, 8)
        finally:
            one.stop()
        d = DaemonProcess(tmp / "state", model, extra_args=["--max-queue", "64"]).start(wait_ready=600)
        try:
            first = first_reports(d)
            rows.update(
                zip(
                    ("in-process c=1", "daemon c=1"),
                    interleaved_c1(d, tmp / "state" / "bundles" / "default-cpu", args.requests),
                )
            )
            for c in (4, 8, 16):
                rows[f"daemon c={c}"] = over_socket(d, args.requests * 2, c)
            soaked = soak(d, args.soak) if args.soak else None
        finally:
            d.stop()
        if args.x1:
            rows.update(x1_rows(tmp, model, args.requests))
        faults = {
            "kill9": kill9_recovery(tmp / "state", model, args.kill9_jobs),
            "overload": overload(tmp / "state", model, args.overload_queue, args.overload_waves),
        }
    base = rows["in-process c=1"]["p50_ms"]
    overhead = rows["daemon c=1"]["p50_ms"] / base - 1
    trained = model == default_model_dir()
    result = {
        "model": str(model.name),
        "weights": "trained"
        if trained
        else "random (radreport-tiny shape)"
        if not args.tiny
        else "random (tiny test shape)",
        "study": STUDY.name,
        "threads": 1,
        "workers": {"daemon": 8, "threads": 8, "serial": 1},
        "max_batch": {"daemon": 8, "threads": 8, "serial": 1},
        "ingest": {
            "daemon": "worker processes (the default)",
            "threads": "the daemon's threads",
            "one ingest process": "one worker process (--ingest-processes 1)",
            "serial": "worker processes",
        },
        "rows": rows,
        "scaling": {
            "daemon_rps_c8_over_c1": rows["daemon c=8"]["throughput_rps"] / rows["daemon c=1"]["throughput_rps"],
            "daemon_p95_c8_over_c1": rows["daemon c=8"]["p95_ms"] / rows["daemon c=1"]["p95_ms"],
            "daemon_rps_c16_over_c1": rows["daemon c=16"]["throughput_rps"] / rows["daemon c=1"]["throughput_rps"],
            "serial_rps_c8_over_c1": rows["serial c=8"]["throughput_rps"] / rows["serial c=1"]["throughput_rps"],
            "daemon_c8_over_serial_c8": rows["daemon c=8"]["throughput_rps"] / rows["serial c=8"]["throughput_rps"],
            "threads_rps_c8_over_c1": rows["threads c=8"]["throughput_rps"] / rows["threads c=1"]["throughput_rps"],
            "daemon_c8_over_threads_c8": rows["daemon c=8"]["throughput_rps"] / rows["threads c=8"]["throughput_rps"],
            "daemon_c8_over_one_ingest_c8": rows["daemon c=8"]["throughput_rps"]
            / rows["one ingest c=8"]["throughput_rps"],
            "daemon_p95_c8_over_one_ingest_c8": rows["daemon c=8"]["p95_ms"] / rows["one ingest c=8"]["p95_ms"],
        },
        "soak": soaked,
        "faults": faults,
        "overhead_c1_p50": overhead,
        "first_reports_after_ready_ms": first,
        "overhead_c1_mean": rows["daemon c=1"]["mean_ms"] / rows["in-process c=1"]["mean_ms"] - 1,
    }
    print(
        f"{'mode':<16}{'n':>5}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'req/s':>9}{'x in-proc p50':>15}"
        f"{'gen p50 ms':>12}{'queue p50 ms':>14}{'ingest wait p50/p95':>21}{'CPU ms d/i/c':>16}{'cores':>7}"
    )
    for name, r in rows.items():
        split = r.get("server_split_p50_ms", {})
        cpu = r.get("cpu_ms_per_report")
        cpu_cell = "/".join(f"{cpu[k]:.1f}" for k in ("daemon", "ingest", "client")) if cpu else "-"
        wait = r.get("ingest_wait_ms")
        wait_cell = f"{wait['p50']:.1f}/{wait['p95']:.1f}" if wait else "-"
        print(
            f"{name:<16}{r['n']:>5}{r['p50_ms']:>10.1f}{r['p95_ms']:>10.1f}{r['p99_ms']:>10.1f}"
            f"{r['throughput_rps']:>9.2f}{r['p50_ms'] / base:>15.2f}"
            f"{split.get('generate_ms', float('nan')):>12.1f}{split.get('queue_ms', float('nan')):>14.1f}"
            f"{wait_cell:>21}{cpu_cell:>16}{r.get('cores_busy', float('nan')):>7.2f}"
        )
    print("CPU ms d/i/c: per report, in the daemon process / its ingest processes / this bench's clients")
    sc = result["scaling"]
    print(
        f"scaling: req/s c=8 / c=1 = {sc['daemon_rps_c8_over_c1']:.2f}x (serial daemon: "
        f"{sc['serial_rps_c8_over_c1']:.2f}x), p95 c=8 / c=1 = {sc['daemon_p95_c8_over_c1']:.2f}x, "
        f"c=16 / c=1 = {sc['daemon_rps_c16_over_c1']:.2f}x; batched / serial at c=8 = "
        f"{sc['daemon_c8_over_serial_c8']:.2f}x; ingest in processes / in threads at c=8 = "
        f"{sc['daemon_c8_over_threads_c8']:.2f}x (threads: c=8 / c=1 = {sc['threads_rps_c8_over_c1']:.2f}x); "
        f"the default ingest processes / one at c=8: req/s {sc['daemon_c8_over_one_ingest_c8']:.2f}x, "
        f"p95 {sc['daemon_p95_c8_over_one_ingest_c8']:.2f}x"
    )
    for name, r in rows.items():
        if "emulated_mj_per_report" in r:
            print(
                f"{name}: emulated {r['emulated_ms_per_report']:.2f} ms and {r['emulated_mj_per_report']:.2f} mJ "
                f"per report ({r['energy_source']})"
            )
    if soaked:
        print(
            f"soak: {soaked['reports']} reports at c={soaked['concurrency']} {soaked['statuses']}; RSS growth after "
            f"the first 100: {soaked['growth_after_100_mib']:.1f} MiB"
        )
    print(
        f"daemon overhead at concurrency 1: {overhead * 100:+.1f}% (p50), "
        f"{result['overhead_c1_mean'] * 100:+.1f}% (mean); model {result['model']}"
    )
    print("first reports after ready, one at a time: " + ", ".join(f"{ms:.1f}" for ms in first) + " ms")
    k, o = faults["kill9"], faults["overload"]
    print(
        f"kill -9: {k['accepted']} accepted, {k['finished_before_kill']} finished before the kill, "
        f"{k['recovered_on_restart']} recovered on restart, {k['succeeded']} succeeded, {k['failed']} failed, "
        f"{k['lost']} lost; ready {k['restart_to_ready_s']:.1f} s after restart, all done "
        f"{k['restart_to_all_done_s']:.1f} s"
    )
    print(
        f"overload: {o['requests']} requests at concurrency {o['concurrency']} (4x capacity {o['capacity']}): "
        f"{o['statuses']}; RSS {o['rss_before_kib'] / 1024:.0f} -> {o['rss_after_kib'] / 1024:.0f} MiB "
        f"(peak {o['rss_peak_kib'] / 1024:.0f}); healthy after: {o['healthy_after']}"
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
