"""The x1 runtime path, measured: memory over many reports in one process, and one cost figure everywhere.

1. RSS over N reports (default 500) in one process on the x1 bundle, beside the cpu bundle of the same model as
   the reference, each through `Reporter` as edgekitd serves them (the three bundled sample studies in turn).
   A backend that kept per-report state would grow here (the previous X1Backend: 139 -> 199 MiB in 60 reports).
2. The emulated energy of one report as `edgekit profile` and as `edgekit eval` state it, on the same x1 bundle
   and study: both go through the x1 target's one run side, so they must agree exactly.

    python bench/x1_runtime.py [--reports 500] [--out bench/x1_runtime.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib.resources import files
from pathlib import Path

from edgekit.build import build
from edgekit.eval.runner import default_test_split, evaluate, load_split
from edgekit.profiling import profile_report
from edgekit.reporter import Reporter

SAMPLES = ("ct_chest", "cr_chest", "us_cardiac")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def rss_over_reports(bundle: Path, n: int) -> dict:
    root = Path(str(files("edgekit.models") / "samples"))
    studies = [root / s for s in SAMPLES]
    reporter = Reporter.from_bundle(bundle, threads=1)
    reporter.report(studies[0], "Cough.")
    first = rss_mib()
    marks = {}
    t0 = time.perf_counter()
    for i in range(n):
        reporter.report(studies[i % len(studies)], "Cough.")
        if (i + 1) in (n // 10, n // 2, n):
            marks[i + 1] = round(rss_mib(), 1)
    last = rss_mib()
    return {
        "rss_after_first_mib": round(first, 1),
        "rss_after_n_mib": round(last, 1),
        "growth_mib": round(last - first, 2),
        "marks_mib": marks,
        "reports": n,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def energy_profile_vs_eval(bundle: Path, tmp: Path) -> dict:
    data = default_test_split()
    study = load_split(data)[0]
    ev = evaluate(Reporter.from_bundle(bundle, threads=1), data, limit=1, include_video=False)
    ev_cost = ev["records"][0]["cost"]
    prof = profile_report(bundle, data / study["path"], study.get("indication", ""), tmp / "profile", threads=1)
    return {
        "study": study["id"],
        "eval_mj": ev_cost["mj_total"],
        "profile_mj": prof["cost"]["mj_total"],
        "eval_emulated_ms": ev_cost["emulated_ms_total"],
        "profile_emulated_ms": prof["cost"]["emulated_ms_total"],
        "same": ev_cost["mj_total"] == prof["cost"]["mj_total"]
        and ev_cost["emulated_ms_total"] == prof["cost"]["emulated_ms_total"],
        "dss": prof["cost"].get("dss", "off"),
        "source": prof["cost"]["source"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reports", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("bench/x1_runtime.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgekit-x1-runtime-") as tmp:
        tmp = Path(tmp)
        bundles = {t: build(t, tmp / t, parity=False).bundle for t in ("x1", "cpu")}
        rss = {t: rss_over_reports(b, a.reports) for t, b in bundles.items()}
        energy = energy_profile_vs_eval(bundles["x1"], tmp)
    doc = {
        "rss": rss,
        "x1_vs_cpu_growth_mib": round(rss["x1"]["growth_mib"] - rss["cpu"]["growth_mib"], 2),
        "energy_profile_vs_eval": energy,
        "source": "VmRSS from /proc/self/status in this one process; emulated figures from the x1 emulator",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2))
    print(f"{'target':<6} {'reports':>7} {'RSS first':>10} {'RSS last':>9} {'growth MiB':>10} {'s':>6}")
    for t, r in rss.items():
        print(
            f"{t:<6} {r['reports']:>7} {r['rss_after_first_mib']:>10} {r['rss_after_n_mib']:>9} "
            f"{r['growth_mib']:>10} {r['seconds']:>6}"
        )
    e = energy
    print(
        f"one report ({e['study']}): profile {e['profile_mj']:.4f} mJ / {e['profile_emulated_ms']:.4f} ms, "
        f"eval {e['eval_mj']:.4f} mJ / {e['eval_emulated_ms']:.4f} ms -> {'same' if e['same'] else 'DIFFERENT'}"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
