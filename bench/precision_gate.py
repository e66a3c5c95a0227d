"""Input-adaptive precision (edgekitd's `[precision_gate]`): does a cheap input statistic that sends a study to the
higher-precision variant help the default model on the X1?

The seed's rule: a study whose input entropy is below 4.2 bits takes the higher-precision path. Here each study of
the test split (DICOM) is reported by the x1 INT4 bundle (the build's default) and by the x1 FP16 bundle; the gate
is replayed on those reports (greedy decoding is deterministic, so a study routed to FP16 gets FP16's report):

- always INT4, always FP16;
- the oracle: per study, whichever variant scored better (ties: INT4), the most any gate could gain;
- the entropy gate (Shannon entropy of the study's display values, 256 bins, in bits) at the seed's 4.2 and at
  thresholds sending 10%, 25% and 50% of studies to FP16.

Finding F1 with a 95% bootstrap interval on the same studies; energy per report from the X1 cost model
(`emulated:x1`). If the oracle gains nothing, no gate can, and the daemon's gate stays off by default.

    python bench/precision_gate.py               # all 240 studies of the test split
    python bench/precision_gate.py --limit 60
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

from edgekit.eval.bootstrap import bootstrap_ci
from edgekit.eval.finding_metrics import prf
from edgekit.eval.runner import default_test_split, evaluate, load_split
from edgekit.ingest import load_study
from edgekit.ingest.entropy import display_entropy_bits as entropy_bits
from edgekit.reporter import Reporter

sys.path.insert(0, str(Path(__file__).parent))
from pareto_front import fresh_bundle  # noqa: E402

SEED_THRESHOLD_BITS = 4.2


def per_study(bundle: Path, data: Path, limit: int) -> dict[str, dict]:
    reporter = Reporter.from_bundle(bundle)
    reporter.warm()
    result = evaluate(reporter, data, limit=limit, include_video=False)
    return {r["id"]: r for r in result["records"] if r.get("error") is None}


def summarise(counts: np.ndarray, energy: np.ndarray) -> dict:
    f1 = prf(*counts.sum(0))[2]
    ci = bootstrap_ci(counts, lambda c: prf(*c.sum(0))[2], resamples=1000, seed=0)
    return {"f1": f1, "f1_ci": list(ci), "energy_j": float(energy.mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=240)
    ap.add_argument("--cache", type=Path, default=Path("out/pareto-bundles"))
    ap.add_argument("--json", type=Path, default=Path("out/precision_gate.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    data = default_test_split()
    studies = load_split(data)[: args.limit]
    low = per_study(fresh_bundle("x1", args.cache / "radreport-tiny-x1-int4", None), data, args.limit)
    high = per_study(fresh_bundle("x1", args.cache / "radreport-tiny-x1-fp16", "fp16"), data, args.limit)
    ids = [s["id"] for s in studies if s["id"] in low and s["id"] in high]
    ent = np.array([entropy_bits(load_study(data / s["path"]).frames) for s in studies if s["id"] in ids])

    def counts(records: dict) -> np.ndarray:
        return np.array([[records[i]["score"][k] for k in ("tp", "fp", "fn")] for i in ids], np.float64)

    def joules(records: dict) -> np.ndarray:
        return np.array([records[i]["energy_j"] for i in ids])

    c_low, c_high, e_low, e_high = counts(low), counts(high), joules(low), joules(high)

    def study_f1(c: np.ndarray) -> np.ndarray:
        tp, fp, fn = c.T
        return np.where(tp + fp + fn > 0, 2 * tp / np.maximum(2 * tp + fp + fn, 1), 1.0)

    oracle = study_f1(c_high) > study_f1(c_low)
    gates = {"always INT4": np.zeros(len(ids), bool), "always FP16": np.ones(len(ids), bool), "oracle": oracle}
    gates[f"entropy < {SEED_THRESHOLD_BITS} (seed)"] = ent < SEED_THRESHOLD_BITS
    for share in (0.10, 0.25, 0.50):
        t = float(np.quantile(ent, share))
        gates[f"entropy < {t:.2f} ({share:.0%})"] = ent < t
    rows = {}
    for name, to_high in gates.items():
        c = np.where(to_high[:, None], c_high, c_low)
        e = np.where(to_high, e_high, e_low)
        rows[name] = {**summarise(c, e), "to_fp16": int(to_high.sum())}
    base = rows["always INT4"]
    for r in rows.values():
        r["f1_change_pt"] = 100 * (r["f1"] - base["f1"])
        r["energy_ratio"] = r["energy_j"] / base["energy_j"]
    int4_wrong = study_f1(c_low) < 1.0
    auc = None
    if (
        0 < int4_wrong.sum() < len(ids)
    ):  # does low entropy flag the studies INT4 gets wrong? (0.5: no better than chance)
        wrong, right = ent[int4_wrong], ent[~int4_wrong]
        auc = float(np.mean([(w < right).mean() + 0.5 * (w == right).mean() for w in wrong]))

    table = Table(title=f"Input-adaptive precision on the X1, {len(ids)} DICOM studies of the test split")
    for col in ("gate", "to FP16", "finding F1 [95% CI]", "vs INT4", "mJ/report (emulated:x1)", "energy vs INT4"):
        table.add_column(col)
    for name, r in rows.items():
        lo, hi = r["f1_ci"]
        table.add_row(name, str(r["to_fp16"]), f"{r['f1']:.4f} [{lo:.3f}, {hi:.3f}]", f"{r['f1_change_pt']:+.2f} pt",
                      f"{r['energy_j'] * 1e3:.3f}", f"{r['energy_ratio']:.3f}x")  # fmt: skip
    Console(width=160).print(table)
    out = {
        "split": {"name": "test", "studies": len(ids), "data": str(data)},
        "energy_source": low[ids[0]]["energy_source"],
        "entropy_bits": {"min": float(ent.min()), "median": float(np.median(ent)), "max": float(ent.max())},
        "int4_wrong_studies": int(int4_wrong.sum()),
        "entropy_auc_for_int4_errors": auc,
        "gates": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    print(
        f"INT4 errs on {int(int4_wrong.sum())} of {len(ids)} studies; FP16 scores better on {int(oracle.sum())}; "
        f"oracle {rows['oracle']['f1_change_pt']:+.2f} pt F1; low entropy flags INT4's errors with AUC "
        f"{'n/a' if auc is None else f'{auc:.2f}'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
