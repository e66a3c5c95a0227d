"""Dynamic head sparsity on the X1, side by side in one run: DSS off vs DSS at the seed's operating point.

For the default model's x1 bundle on a small synthetic test split: the skip rate DSS reached against its target,
finding F1 (and its change vs DSS off), and the emulated time and energy per report and per token it saved.
A third row, "budget-bound" (threshold 1.0: every head is a candidate, so the target is reached exactly), shows
what skipping 38 % of heads buys and costs when the threshold does not hold DSS back.

    python bench/x1_dss.py [--bundle out/radreport-tiny-x1] [--n 12] [--json out/x1_dss.json]

Without --bundle the default model is built for x1 first (`edgekit.build.build("x1", ...)`), which needs the
trained weights in models/radreport_tiny/weights/.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from edgekit.eval.runner import evaluate
from edgekit.models.synth import write_split
from edgekit.targets.x1.engine import SparseConfig, X1Engine


class _Recording:
    """The engine as a reporter for `evaluate`, keeping each report's emulated stats."""

    def __init__(self, engine: X1Engine):
        self.engine, self.stats = engine, []
        self.bundle = engine.bundle

    def report(self, study, prompt: str = "", options=None):
        rep = self.engine.report(study, prompt, options)
        self.stats.append(dict(self.engine.last_stats))
        return rep


def run(bundle: Path, split: Path, configs: dict[str, SparseConfig]) -> list[dict]:
    rows = []
    for name, cfg in configs.items():
        rec = _Recording(X1Engine(bundle, cfg))
        t0 = time.perf_counter()
        result = evaluate(rec, split, include_video=False, resamples=200)["overall"]
        wall = time.perf_counter() - t0
        s = rec.stats
        n = max(len(s), 1)
        skipped = sum(x.get("dss", {}).get("heads_skipped", 0) for x in s)
        total = sum(x.get("dss", {}).get("heads_total", 0) for x in s)
        decode_steps = sum(x["decode_steps"] for x in s) or 1
        rows.append(
            {
                "config": name,
                "sparsity_target": cfg.sparsity_target if cfg.dss_active else 0.0,
                "threshold": cfg.sensitivity_threshold if cfg.dss_active else None,
                "skip_rate": skipped / total if total else 0.0,
                "finding_f1": result["finding_f1"]["value"],
                "finding_f1_ci95": result["finding_f1"]["ci95"],
                "reports": len(s),
                "tokens": sum(x["tokens"] for x in s),
                "emulated_ms_per_report": sum(x["emulated_ms_total"] for x in s) / n,
                "mj_per_report": sum(x["mj_total"] for x in s) / n,
                "emulated_ms_per_token": sum(x["emulated_ms_per_token"] * x["decode_steps"] for x in s) / decode_steps,
                "mj_per_token": sum(x["mj_per_token"] * x["decode_steps"] for x in s) / decode_steps,
                "wall_s": wall,
            }
        )
    base = rows[0]
    for r in rows:
        r["finding_f1_change_points"] = 100 * (r["finding_f1"] - base["finding_f1"])
        for k in ("emulated_ms_per_token", "mj_per_token", "emulated_ms_per_report", "mj_per_report"):
            r[f"{k}_ratio_vs_off"] = r[k] / base[k] if base[k] else float("nan")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="x1 bundle (default: build the default model for x1)")
    ap.add_argument("--n", type=int, default=12, help="studies in the synthetic test split")
    ap.add_argument("--target", type=float, default=0.38)
    ap.add_argument("--threshold", type=float, default=0.015)
    ap.add_argument("--json", type=Path, default=Path("out/x1_dss.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="x1dss-") as tmp:
        bundle = a.bundle
        if bundle is None:
            from edgekit.build import build

            bundle = build("x1", Path(tmp) / "radreport-tiny-x1", parity=False).bundle
        split = write_split(Path(tmp) / "split", "test", a.n)
        split = split.parent if split.is_file() else split
        configs = {
            "DSS off": SparseConfig(enable_sparsity=False),
            f"DSS {a.target}/{a.threshold}": SparseConfig(sparsity_target=a.target, sensitivity_threshold=a.threshold),
            f"budget-bound {a.target}/1.0": SparseConfig(sparsity_target=a.target, sensitivity_threshold=1.0),
        }
        rows = run(bundle, split, configs)
    doc = {
        "bundle": str(a.bundle or "default model built for x1"),
        "split": f"synthetic test, {a.n} studies (no video)",
        "rows": rows,
        "source": "bench/x1_dss.py: edgekit eval finding F1 + X1 emulator emulated time/energy",
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=2))
    cols = (
        "config",
        "skip_rate",
        "finding_f1",
        "finding_f1_change_points",
        "emulated_ms_per_token",
        "mj_per_token",
        "emulated_ms_per_token_ratio_vs_off",
        "mj_per_token_ratio_vs_off",
        "emulated_ms_per_report",
        "mj_per_report",
    )
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
