"""Reports under a cgroup CPU quota, side by side in one run: threads sized from the affinity alone (what edgekit did
before `edgekit/cpus.py`: ONNX Runtime at the physical cores the process may run on, JPEG 2000 at every CPU it may
run on) against edgekit's own choice now (the affinity within the quota, rounded down), and edgekit's choice with
no quota for reference.

A CPU quota is what systemd's CPUQuota=, `docker run --cpus` and a Kubernetes CPU limit (our Helm chart sets 2) give
a process: its affinity still shows every CPU. In-process: a child process started in the cgroup loads the default
model's cpu bundle and writes `--reports` reports on the bundled sample study as `edgekit run` does (after 5 to warm
up); the sizings alternate, `--rounds` times. `--daemon` adds edgekitd started inside the cgroup (its ingest
processes with it; "before" also with the ingest processes the affinity gave, half the physical cores, 2 to 4, and
ONNX Runtime's threads spinning between runs, as before `daemon/cpu_share.py`) and served from this process, outside
it, at concurrency 1 and 4, each sizing first for every other quota. Per row: p50 / p95 ms, reports/s, the threads
used, and the periods and seconds the kernel throttled the cgroup over the timed reports (its cpu.stat). Needs root
and a writable cgroup file system with the cpu controller. Prints a table, writes JSON.

    python bench/cpu_quota.py [--quotas 1 1.5] [--reports 60] [--rounds 2] [--daemon] [--out bench/cpu_quota.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgekit.daemon.testing import DaemonProcess, QuotaCgroup, cgroup_throttled

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_load import over_socket, stats  # noqa: E402 - a bench beside this one: serving and its figures

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "models" / "samples" / "cr_chest" / "image.dcm"
DECODE_ENV = "OPJ_NUM_THREADS"


def affinity_sized() -> tuple[int, int]:
    """(ONNX Runtime threads, JPEG 2000 threads) as the affinity alone gives them, the rule before the quota was
    read: computed in this process, which runs under no quota (`main` checks)."""
    from edgekit.ort import physical_cores

    return physical_cores(), len(os.sched_getaffinity(0))


def child(bundle: str, ort_threads: str, decode: str, n: int, cgroup: str) -> None:
    """One sizing's reports, in this process (started inside `cgroup`, "-": none); the throttling is read around
    the timed reports only."""
    from edgekit.ingest.decode_threads import decode_threads, set_threads
    from edgekit.reporter import Reporter

    if decode == "auto":
        set_threads(decode_threads())  # as `edgekit run` does
    else:
        os.environ[DECODE_ENV] = decode
    reporter = Reporter.from_bundle(bundle, threads=None if ort_threads == "auto" else int(ort_threads))
    for _ in range(5):
        reporter.report(STUDY)
    lat = []
    before = cgroup_throttled(Path(cgroup)) if cgroup != "-" else (0, 0.0)
    for _ in range(n):
        t = time.perf_counter()
        reporter.report(STUDY)
        lat.append(time.perf_counter() - t)
    after = cgroup_throttled(Path(cgroup)) if cgroup != "-" else (0, 0.0)
    used = {"ort": reporter.backend.intra_op_threads, "decode": int(os.environ[DECODE_ENV])}
    throttled = [after[0] - before[0], after[1] - before[1]]
    print(json.dumps({"latencies_s": lat, "threads": used, "throttled": throttled}))


def in_process(group: QuotaCgroup | None, bundle: Path, sizing: tuple[str, str], n: int) -> dict:
    args = [sys.executable, __file__, "--child", str(bundle), *sizing, str(n), str(group.path) if group else "-"]
    out = subprocess.run(group.wrap(args) if group else args, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    row = stats(got["latencies_s"], sum(got["latencies_s"]))
    row["threads"] = got["threads"]
    row["throttled_periods"], row["throttled_s"] = got["throttled"]
    return row


def daemon_rows(group: QuotaCgroup, state: Path, extra: list[str], env: dict, settings: str, n: int) -> dict:
    """edgekitd started in the cgroup (its own thread choice unless `extra` sets one; `settings`: its [daemon]
    section), served from outside it."""
    from edgekit.build import default_model_dir

    state.mkdir(parents=True)
    (state / "edgekitd.toml").write_text(f"[daemon]\n{settings}\n")
    d = DaemonProcess(
        state,
        default_model_dir(),
        config=state / "edgekitd.toml",
        extra_args=["--max-queue", "64", *extra],
        env=env,
        threads=None,
    )
    rows = {}
    with d.start(args=group.wrap(d.args), wait_ready=600):
        for c in (1, 4):
            before = group.throttled()
            row = over_socket(d, n * (2 if c > 1 else 1), c)
            after = group.throttled()
            if row["statuses"] != {"200": row["n"]}:
                raise SystemExit(f"{state.name}: reports failed: {row['statuses']}")
            row["throttled_periods"], row["throttled_s"] = after[0] - before[0], after[1] - before[1]
            row["plan"] = d.cpu_plan()
            rows[f"c={c}"] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quotas", type=float, nargs="+", default=[1.0, 1.5], help="CPU quotas to run under")
    ap.add_argument("--reports", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the sizings per quota")
    ap.add_argument("--daemon", action="store_true", help="also edgekitd inside the cgroup at c=1 and c=4")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        bundle, ort_threads, decode, n, cgroup = args.child
        return child(bundle, ort_threads, decode, int(n), cgroup)
    from edgekit.cpus import cpu_quota

    if cpu_quota() is not None:
        raise SystemExit("cpu_quota: this process runs under a CPU quota already; run it where none applies")
    hierarchy = QuotaCgroup.find()
    if hierarchy is None:
        raise SystemExit("cpu_quota: needs root and a writable cgroup file system with the cpu controller")
    ort_old, decode_old = affinity_sized()
    # the daemon's ingest processes as the affinity alone gave them too (half the physical cores, 2 to 4)
    # and its pool threads spinning between runs, as every edgekitd did before daemon/cpu_share.py
    before_args = ["--threads", str(ort_old), "--ingest-processes", str(max(2, min(4, ort_old // 2)))]
    sizings = {"affinity-sized (before)": (str(ort_old), str(decode_old)), "edgekit's choice": ("auto", "auto")}
    result: dict = {"affinity_cpus": len(os.sched_getaffinity(0)), "study": STUDY.name, "quotas": {}}
    with tempfile.TemporaryDirectory(prefix="edgekit-quota-") as tmp:
        tmp = Path(tmp)
        bundle = tmp / "bundle"
        from edgekit.build import build

        build("cpu", bundle, parity=False)
        reference = in_process(None, bundle, ("auto", "auto"), args.reports)
        result["no quota, edgekit's choice"] = reference
        for q, quota in enumerate(args.quotas):
            runs: dict[str, list[dict]] = {name: [] for name in sizings}
            with QuotaCgroup(hierarchy, quota) as group:
                for r in range(args.rounds):
                    order = list(sizings.items()) if r % 2 == 0 else list(reversed(sizings.items()))
                    for name, sizing in order:
                        runs[name].append(in_process(group, bundle, sizing, args.reports))
                entry: dict = {"in_process": runs}
                if args.daemon:
                    n = args.reports
                    served = {  # name: (state folder, daemon arguments, environment, [daemon] settings)
                        "affinity-sized (before)": (
                            "before",
                            before_args,
                            {DECODE_ENV: str(decode_old)},
                            "ort_spinning = true",
                        ),
                        "edgekit's choice": ("now", [], {}, ""),
                    }
                    firsts = list(served) if q % 2 == 0 else list(reversed(served))  # each goes first once
                    entry["daemon"] = {
                        name: daemon_rows(group, tmp / f"{served[name][0]}-{quota:g}", *served[name][1:], n)
                        for name in firsts
                    }
            result["quotas"][f"{quota:g}"] = entry
    print(f"{'quota':<7}{'sizing':<26}{'ORT/J2K thr':>12}{'p50 ms':>9}{'p95 ms':>9}{'rep/s':>8}{'throttled':>11}")
    r = reference
    print(
        f"{'none':<7}{'edgekit':<26}{r['threads']['ort']:>6}/{r['threads']['decode']:<5}{r['p50_ms']:>9.1f}"
        f"{r['p95_ms']:>9.1f}{r['throughput_rps']:>8.1f}{'-':>11}"
    )
    for quota, entry in result["quotas"].items():
        for name, rows in entry["in_process"].items():
            for row in rows:
                t = row["threads"]
                print(
                    f"{quota:<7}{name:<26}{t['ort']:>6}/{t['decode']:<5}{row['p50_ms']:>9.1f}{row['p95_ms']:>9.1f}"
                    f"{row['throughput_rps']:>8.1f}{row['throttled_periods']:>6} / {row['throttled_s']:.1f}s"
                )
        mine = np.median([x["p50_ms"] for x in entry["in_process"]["edgekit's choice"]])
        old = np.median([x["p50_ms"] for x in entry["in_process"]["affinity-sized (before)"]])
        entry["p50_before_over_now"] = float(old / mine)
        print(f"quota {quota}: in-process p50, affinity-sized / edgekit's choice = {old / mine:.2f}x")
        for name, rows in entry.get("daemon", {}).items():
            for c, row in rows.items():
                print(
                    f"{quota:<7}edgekitd {c} {name:<17}{row['p50_ms']:>18.1f}{row['p95_ms']:>9.1f}"
                    f"{row['throughput_rps']:>8.1f}{row['throttled_periods']:>6} / {row['throttled_s']:.1f}s"
                )
            print(f"        edgekitd plan ({name}): {rows['c=1']['plan']}")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
