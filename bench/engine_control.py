"""Batch-size controllers under Poisson arrivals, side by side in one run: fixed, the bandwidth rule, a latency
target (`edgekit.engine.control`), on the cpu and x1 bundles of the default model.

Each controller serves the same arrival schedule (seeded Poisson at `--load` times the engine's measured one-row
capacity) of one pre-ingested study through one `Reporter` (in-process: no HTTP, ingest done once), so what differs
is only how many rows decode together. Reported per controller: throughput, p50/p95 latency from arrival, energy
per report and where it comes from (x1: emulated by its cost model, summed over the reports; cpu: the run's energy
from `edgekit.energy`'s sampler, RAPL when this machine exposes it, else its CPU-time estimate, divided by the
reports), the mean batch and the bandwidth utilisation the steps reached. Controllers run in alternating order
across `--repeats` rounds (these machines are noisy); the table gives medians.

    python bench/engine_control.py [--targets cpu,x1] [--requests 48] [--load 1.5,4] [--out bench/engine_control.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from edgekit.engine.control import copy_bandwidth

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "models" / "samples" / "cr_chest" / "image.dcm"
CONTROLLERS = ("fixed", "bandwidth", "latency")


def capacity(reporter, study, n: int = 6) -> float:
    """Reports per second one at a time (the arrival rates are multiples of it)."""
    reporter.report(study)
    t0 = time.perf_counter()
    for _ in range(n):
        reporter.report(study)
    return n / (time.perf_counter() - t0)


def serve(reporter, study, arrivals: np.ndarray, sampler) -> dict:
    """Every arrival a thread that waits for its time, then writes the report; latencies from arrival."""
    lat, cost_j, sources = [None] * len(arrivals), [0.0] * len(arrivals), set()
    start = time.perf_counter() + 0.05

    def one(i):
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        t = time.perf_counter()
        rep = reporter.report(study)
        lat[i] = time.perf_counter() - t + max(0.0, t - (start + arrivals[i]))
        if rep.energy_source and rep.energy_source.startswith("emulated"):
            cost_j[i] = rep.energy_j
            sources.add(rep.energy_source)

    engine = reporter.engine
    steps0, tokens0 = engine.stats.steps, engine.stats.tokens
    mark = sampler.mark() if sampler is not None else None
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(arrivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    steps, tokens = engine.stats.steps - steps0, engine.stats.tokens - tokens0
    if sources:
        energy, source = sum(cost_j) / len(arrivals), sorted(sources)[0]
    else:
        reading = sampler.since(mark) if sampler is not None else None
        energy = reading.joules / len(arrivals) if reading is not None else None
        source = reading.source if reading is not None else None
    ms = np.asarray(lat) * 1e3
    bw = engine.stats.bandwidth()
    limit = getattr(engine.slots, "bandwidth_limit_bytes_per_s", None) or copy_bandwidth()
    return {
        "throughput_rps": len(arrivals) / wall,
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "energy_j_per_report": energy,
        "energy_source": source,
        "mean_batch": tokens / steps if steps else 0.0,
        "bandwidth_utilisation": bw / limit if bw and limit else None,
    }


def bundle_for(target: str, tmp: Path) -> Path:
    from edgekit.build import build, default_model_dir

    out = tmp / f"default-{target}"
    build(target, out, model_dir=default_model_dir(), parity=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="cpu,x1")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--load", default="1.5,4", help="arrival rates as multiples of the one-row capacity")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--latency-target-ms", type=float, default=0.0, help="0: twice the one-row step time")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "engine_control.json")
    args = ap.parse_args()
    from edgekit.energy.discover import open_sampler
    from edgekit.ingest import load_study
    from edgekit.reporter import Reporter

    study = load_study(STUDY)
    sampler = open_sampler().start()
    result = {"study": STUDY.name, "requests": args.requests, "max_batch": args.max_batch, "runs": {}}
    result["copy_bandwidth_gb_s"] = copy_bandwidth() / 1e9
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgekit-control-") as tmp:
        for target in args.targets.split(","):
            bundle = bundle_for(target, Path(tmp))
            one = Reporter.from_bundle(bundle, threads=1, max_batch=1)
            cap = capacity(one, study)
            step_s = statistics.median(s for _, s, _ in one.engine.stats.recent)
            one.close()
            target_s = args.latency_target_ms / 1e3 or 2.0 * step_s
            for load in (float(x) for x in args.load.split(",")):
                rng = np.random.default_rng(0)
                arrivals = np.cumsum(rng.exponential(1 / (load * cap), args.requests))
                runs: dict[str, list[dict]] = {c: [] for c in CONTROLLERS}
                for rep in range(args.repeats):
                    for name in CONTROLLERS if rep % 2 == 0 else reversed(CONTROLLERS):
                        reporter = Reporter.from_bundle(
                            bundle, threads=1, max_batch=args.max_batch, controller=name, latency_target_s=target_s
                        )
                        reporter.warm()
                        runs[name].append(serve(reporter, study, arrivals, sampler))
                        reporter.close()
                for name, rs in runs.items():
                    med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
                    row = {"target": target, "load": load, "controller": name, **med}
                    row["energy_source"] = rs[0]["energy_source"]
                    rows.append(row)
                result["runs"][f"{target}@{load}"] = {
                    "capacity_rps_one_row": cap,
                    "latency_target_ms": target_s * 1e3,
                    "runs": runs,
                }
    result["table"] = rows
    print(
        f"{'target':<7}{'load':>5}  {'controller':<10}{'req/s':>8}{'p50 ms':>9}{'p95 ms':>9}{'mJ/report':>11}"
        f"{'batch':>7}{'bw util':>9}  energy source"
    )
    for r in rows:
        e = r.get("energy_j_per_report")
        bw = r.get("bandwidth_utilisation")
        print(
            f"{r['target']:<7}{r['load']:>5.1f}  {r['controller']:<10}{r['throughput_rps']:>8.2f}{r['p50_ms']:>9.1f}"
            f"{r['p95_ms']:>9.1f}{(e * 1e3 if e is not None else float('nan')):>11.2f}{r['mean_batch']:>7.2f}"
            f"{(bw * 100 if bw is not None else float('nan')):>8.1f}%  {r['energy_source']}"
        )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
