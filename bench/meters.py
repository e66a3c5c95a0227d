"""The energy sampler side by side at 10, 50 and 200 ms: what it costs and how close it integrates.

1. Overhead: the CPU time of the sampling thread per second of wall time, for two meters (the INA3221 reader on
   the AGX Orin fixture tree: 4 rails, 8 file reads per sample; the CPU-time estimate: no file at all), and a
   CPU-bound workload's throughput with the sampler running against none (ratio, 1.00 = no slowdown).
2. Integration error: a meter with a known power profile (its exact integral computed analytically) read in
   real time, windows of 0.25 s, 1 s and 3 s like reports of those lengths; the error is |measured - exact| /
   exact, mean and worst over the windows. Two profiles: "bursty" (4 W idle, +8 W bursts of 120 ms every
   300 ms: the worst case for a trapezoid) and "smooth" (6 W + 2 W sine at 2.5 Hz).

    python bench/meters.py [--seconds 3] [--json out/meters.json]

The fixture tree is on the disk, not a real sysfs: on a Jetson each INA3221 attribute read is an I2C transfer,
so the per-sample cost there is higher than here (run it on the board with --root / to see).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import statistics
import time
from pathlib import Path

from edgekit.energy import CpuTimeMeter, Ina3221Meter, PowerReading, Sampler, measured

INTERVALS = (0.01, 0.05, 0.2)
REPO = Path(__file__).resolve().parents[1]


class Profile:
    """A power profile P(t) with its exact integral. "bursty": 4 W idle and +8 W bursts of 40-200 ms after gaps of
    30-300 ms, at seeded random times (aperiodic, so no sampling interval locks onto it); "smooth": 6 W + 2 W sine
    at 2.5 Hz."""

    def __init__(self, name: str, start: float, span: float = 600.0):
        self.name = name
        rng = random.Random(11)
        self.bursts, t = [], start
        while t < start + span:
            t += rng.uniform(0.03, 0.3)
            d = rng.uniform(0.04, 0.2)
            self.bursts.append((t, t + d))
            t += d
        self._starts = [b[0] for b in self.bursts]

    def watts(self, t: float) -> float:
        if self.name == "bursty":
            i = bisect.bisect_right(self._starts, t) - 1
            return 4.0 + (8.0 if i >= 0 and t < self.bursts[i][1] else 0.0)
        return 6.0 + 2.0 * math.sin(2 * math.pi * 2.5 * t)

    def energy(self, t0: float, t1: float) -> float:
        """The exact joules from t0 to t1."""
        if self.name == "bursty":
            inside = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.bursts if a < t1 and b > t0)
            return 4.0 * (t1 - t0) + 8.0 * inside
        w = 2 * math.pi * 2.5
        return 6.0 * (t1 - t0) - 2.0 / w * (math.cos(w * t1) - math.cos(w * t0))


class ProfileMeter:
    """The bench's input: readings of a known profile on the monotonic clock."""

    def __init__(self, profile: Profile):
        self.profile, self.source = profile, measured(f"bench:{profile.name}")

    def read(self) -> PowerReading:
        t = time.monotonic()
        return PowerReading(self.profile.watts(t), self.source, t)

    def describe(self) -> dict:
        return {"source": self.source}


def busy_work(seconds: float) -> int:
    """Iterations of a pure-Python loop in `seconds` (holds the GIL like a Python-side workload would)."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(1000))
        n += 1
    return n


def overhead(meter_factory, interval: float, seconds: float, blocks: int = 6) -> dict:
    """`blocks` pairs of (workload alone, workload with the sampler), alternating so that load from elsewhere on
    the machine hits both alike; the workload ratio is the median over the pairs."""
    meter = meter_factory()
    t0 = time.perf_counter()
    for _ in range(200):
        meter.read()
    read_s = (time.perf_counter() - t0) / 200
    block = seconds / (2 * blocks)
    ratios, cpu, wall = [], 0.0, 0.0
    s = Sampler([meter], interval)
    for _ in range(blocks):
        alone = busy_work(block)
        s.start()
        w0, c0 = time.monotonic(), s.thread_cpu_s
        with_sampler = busy_work(block)
        s.stop()
        wall += time.monotonic() - w0
        cpu += s.thread_cpu_s - c0
        ratios.append(with_sampler / alone)
    return {
        "meter": meter.source,
        "interval_ms": interval * 1e3,
        "read_us": read_s * 1e6,
        "sampler_cpu_ms_per_s": cpu / wall * 1e3,
        "sampler_cpu_pct_of_core": cpu / wall * 100,
        "workload_ratio": statistics.median(ratios),
        "workload_ratio_range": [min(ratios), max(ratios)],
    }


def accuracy(profile: Profile, interval: float, lengths=(0.25, 1.0, 3.0), repeats=3) -> list[dict]:
    out = []
    with Sampler([ProfileMeter(profile)], interval) as s:
        for length in lengths:
            errs = []
            for k in range(repeats):
                time.sleep(0.037 * k)  # windows start at different phases of the profile
                with s.window() as w:
                    time.sleep(length)
                exact = profile.energy(w.t_start, w.t_end)
                errs.append(abs(w.joules - exact) / exact)
            out.append(
                {
                    "profile": profile.name,
                    "interval_ms": interval * 1e3,
                    "window_s": length,
                    "mean_error_pct": 100 * sum(errs) / len(errs),
                    "max_error_pct": 100 * max(errs),
                    "windows": len(errs),
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per overhead run (half without, half with)")
    ap.add_argument("--root", type=Path, default=REPO / "tests/fixtures/sysfs/agx_orin", help="INA3221 tree")
    ap.add_argument("--json", type=Path, default=Path("out/meters.json"))
    a = ap.parse_args()

    meters = {"ina3221": lambda: Ina3221Meter(a.root), "cpu-time": CpuTimeMeter}
    over = [overhead(f, iv, a.seconds) for f in meters.values() for iv in INTERVALS]
    acc = [row for p in ("bursty", "smooth") for iv in INTERVALS for row in accuracy(Profile(p, time.monotonic()), iv)]

    print("sampler overhead (CPU time of the sampling thread; workload = iterations with / without the sampler)")
    print(f"{'meter':<56} {'interval':>9} {'read':>8} {'CPU ms/s':>9} {'% core':>7} {'workload':>9}")
    for r in over:
        print(
            f"{r['meter']:<56} {r['interval_ms']:>7.0f}ms {r['read_us']:>6.1f}us {r['sampler_cpu_ms_per_s']:>9.3f} "
            f"{r['sampler_cpu_pct_of_core']:>6.2f}% {r['workload_ratio']:>9.3f}"
        )
    print("\nintegration error against the exact integral of a known profile (|measured - exact| / exact)")
    print(f"{'profile':<8} {'interval':>9} {'window':>7} {'mean':>8} {'worst':>8}")
    for r in acc:
        print(
            f"{r['profile']:<8} {r['interval_ms']:>7.0f}ms {r['window_s']:>6.2f}s "
            f"{r['mean_error_pct']:>7.2f}% {r['max_error_pct']:>7.2f}%"
        )
    doc = {
        "what": "edgekit.energy.Sampler overhead and integration error at 10/50/200 ms",
        "ina3221_tree": str(a.root),
        "note": "fixture tree on disk, not a real sysfs: on a Jetson each attribute read is an I2C transfer",
        "overhead": over,
        "accuracy": acc,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()
