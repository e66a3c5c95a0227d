"""The seed's joint compression table on our model, side by side in one run, on the X1 emulator.

Rows: FP16 (the X1's float path; its weights are what FP32 halves), INT4, INT4 + DSS at sparsity targets 0.25 /
0.38 / 0.5 (threshold 0.015, the seed's), INT4 + co-pruning by joint sensitivity |dL/dw| E|a| at tau 0.1 / 0.2 /
0.3, and INT4 + co-pruning by the gradient-free |w| E|a| at tau 0.2 for comparison. Per row: memory (the
bundle's X1 program files, against what FP32 weights of the same model take), memory if the pruned blocks were stored
compressed (an estimate: kept 4x4 blocks plus a bit per block), emulated X1 time and energy per report, finding
F1 with its 95% CI and the hallucinated-finding rate on the synthetic test split, DSS's reached skip rate, and
ratios against the FP16 row and against INT4 dense.

    python bench/compression_table.py [--weights DIR] [--n 60] [--json out/compression_table.json]

Needs the train extra (torch) for the gradient step of co-pruning. The X1 skips heads (DSS) but not zero weight
blocks: co-pruning changes quality there, not time or energy, and the table says so rather than hide the rows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from edgekit.build import build, default_model_dir
from edgekit.eval.runner import evaluate
from edgekit.models.radreport_tiny.family import FAMILY
from edgekit.models.synth import write_split
from edgekit.targets.x1.engine import SparseConfig, X1Engine

SEED_THRESHOLD = 0.015


class Recording:
    """The engine as a reporter for `evaluate`, keeping each report's emulated stats."""

    def __init__(self, engine: X1Engine):
        self.engine, self.stats, self.bundle = engine, [], engine.bundle

    def report(self, study, prompt: str = "", options=None):
        rep = self.engine.report(study, prompt, options)
        self.stats.append(dict(self.engine.last_stats))
        return rep


def copruning_recipe(path: Path, tau: float, score: str, scores: Path) -> Path:
    """The bundled int4 recipe with co-pruning first."""
    int4 = FAMILY.recipe_path("int4").read_text()
    body = int4[int4.index("[[pass]]") :]  # its passes, without its name and description
    path.write_text(
        f'name = "int4-coprune-{score}-{tau}"\ndescription = "co-pruning ({score}) at tau {tau}, then int4"\n\n'
        f'[[pass]]\nname = "copruning"\ntau = {tau}\nscore = "{score}"\nscores = "{scores}"\n\n{body}\n'
    )
    return path


def weight_bytes(bundle: Path) -> int:
    doc = json.loads((bundle / "manifest.json").read_text())
    return sum(c["bytes"] for c in doc["components"].values() if c["path"].endswith(".x1"))  # what the NPU loads


def copruning_notes(bundle: Path) -> dict | None:
    doc = json.loads((bundle / "manifest.json").read_text())
    for step in doc["provenance"]["passes"]:
        for rep in step.get("passes", []):
            if rep.get("pass_name") == "copruning":
                return rep.get("notes", {})
    return None


def block_compressed_bytes(notes: dict, dense_bytes: int) -> int:
    """An estimate for a co-pruned bundle: the INT4 dense size, less half a byte for every weight the pass
    zeroed (whole 4x4 blocks), plus one bit per block for the occupancy map. From the pass's own notes."""
    return int(dense_bytes - 0.5 * notes["weights_zeroed"] + notes["blocks"] / 8)


def evaluate_row(name: str, bundle: Path, split: Path, cfg: SparseConfig) -> dict:
    rec = Recording(X1Engine(bundle, cfg))
    t0 = time.perf_counter()
    overall = evaluate(rec, split, include_video=False, resamples=1000)["overall"]
    s, n = rec.stats, max(len(rec.stats), 1)
    skipped = sum(x.get("dss", {}).get("heads_skipped", 0) for x in s)
    total = sum(x.get("dss", {}).get("heads_total", 0) for x in s)
    return {
        "variant": name,
        "bundle": bundle.name,
        "dss": {"target": cfg.sparsity_target, "threshold": cfg.sensitivity_threshold} if cfg.dss_active else None,
        "skip_rate": skipped / total if total else 0.0,
        "finding_f1": overall["finding_f1"]["value"],
        "finding_f1_ci95": overall["finding_f1"]["ci95"],
        "hallucinated_finding_rate": overall["hallucinated_finding_rate"],
        "reports": len(s),
        "emulated_ms_per_report": sum(x["emulated_ms_total"] for x in s) / n,
        "mj_per_report": sum(x["mj_total"] for x in s) / n,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=None, help="weights directory (default: the embedded model)")
    ap.add_argument("--n", type=int, default=60, help="studies of the synthetic test split (no video)")
    ap.add_argument("--json", type=Path, default=Path("out/compression_table.json"))
    ap.add_argument("--plot", type=Path, default=Path("out/compression_table.png"))
    a = ap.parse_args()
    weights = a.weights or default_model_dir()
    config = json.loads((weights / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(weights / "model.safetensors"), framework="numpy") as f:
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    rows = []
    with tempfile.TemporaryDirectory(prefix="compression-") as tmp:
        tmp = Path(tmp)
        split = write_split(tmp / "split", "test", a.n)
        split = split.parent if split.is_file() else split
        from edgekit.models.radreport_tiny.sensitivity import main as sensitivity

        scores = tmp / "scores.safetensors"
        step = sensitivity(["--out", str(scores), "--weights", str(weights)])
        bundles = {
            "FP16": build("x1", tmp / "fp16", model_dir=weights, parity=False, recipe="fp16").bundle,
            "INT4": build("x1", tmp / "int4", model_dir=weights, parity=False, recipe="int4").bundle,
        }
        for tau, score in ((0.1, "gradient"), (0.2, "gradient"), (0.3, "gradient"), (0.2, "activation")):
            recipe = copruning_recipe(tmp / f"cp-{score}-{tau}.toml", tau, score, scores)
            label = f"INT4 + co-prune {'|dL/dw|E|a|' if score == 'gradient' else '|w|E|a|'} tau {tau}"
            bundles[label] = build(
                "x1", tmp / f"cp-{score}-{tau}", model_dir=weights, parity=False, recipe=recipe
            ).bundle
        plan = [
            ("FP16", "FP16", SparseConfig(enable_sparsity=False)),
            ("INT4", "INT4", SparseConfig(enable_sparsity=False)),
        ]
        plan += [
            (f"INT4 + DSS {t}", "INT4", SparseConfig(sparsity_target=t, sensitivity_threshold=SEED_THRESHOLD))
            for t in (0.25, 0.38, 0.5)
        ]
        plan += [(label, label, SparseConfig(enable_sparsity=False)) for label in bundles if "co-prune" in label]
        dense_int4 = weight_bytes(bundles["INT4"])
        for name, key, cfg in plan:
            print(f"{name} ...", flush=True)
            row = evaluate_row(name, bundles[key], split, cfg)
            row["memory_bytes"] = weight_bytes(bundles[key])
            notes = copruning_notes(bundles[key])
            row["pruned_weight_share"] = notes["sparsity_overall"] if notes else 0.0
            row["memory_bytes_block_compressed_estimate"] = (
                block_compressed_bytes(notes, dense_int4) if notes else row["memory_bytes"]
            )
            rows.append(row)
    fp32 = params * 4
    base, int4 = rows[0], rows[1]
    for r in rows:
        r["memory_vs_fp32"] = r["memory_bytes"] / fp32
        r["memory_compressed_vs_fp32"] = r["memory_bytes_block_compressed_estimate"] / fp32
        r["f1_change_points_vs_int4"] = 100 * (r["finding_f1"] - int4["finding_f1"])
        for k in ("emulated_ms_per_report", "mj_per_report"):
            r[f"{k}_vs_fp16"] = r[k] / base[k]
            r[f"{k}_vs_int4"] = r[k] / int4[k]
    doc = {
        "weights": str(weights),
        "params": params,
        "fp32_weight_bytes": fp32,
        "heads": {"layers": config["layers"], "heads": config["heads"]},
        "split": f"synthetic test split, first {a.n} studies (DICOM, no video); F1 CI: 1000 bootstrap resamples",
        "energy_source": "emulated: X1 emulator (targets/x1), per report",
        "memory_source": "the bundle's X1 program files (weights as the NPU loads them); FP32 = parameters x 4 B; "
        "packed: an estimate if the zeroed 4x4 blocks were not stored (the X1 stores them today)",
        "sensitivity_step": step,
        "rows": rows,
        "source": "bench/compression_table.py",
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=2))
    header = f"{'variant':36s} {'pruned':>6s} {'mem/FP32':>8s} {'(packed)':>8s} {'ms/rep':>8s} {'mJ/rep':>8s} "
    header += f"{'E/FP16':>7s} {'E/INT4':>7s} "
    header += f"{'skip':>5s} {'F1 [95% CI]':>22s} {'dF1 pt':>7s} {'halluc':>7s}"
    print(header)
    for r in rows:
        lo, hi = r["finding_f1_ci95"]
        print(
            f"{r['variant']:36s} {r['pruned_weight_share']:6.3f} {r['memory_vs_fp32']:8.3f} "
            f"{r['memory_compressed_vs_fp32']:8.3f} {r['emulated_ms_per_report']:8.2f} "
            f"{r['mj_per_report']:8.3f} {r['mj_per_report_vs_fp16']:7.3f} {r['mj_per_report_vs_int4']:7.3f} "
            f"{r['skip_rate']:5.2f} {r['finding_f1']:.3f} [{lo:.3f}, {hi:.3f}]  {r['f1_change_points_vs_int4']:+7.1f} "
            f"{r['hallucinated_finding_rate']:7.3f}"
        )
    plot(rows, a.plot)
    print(f"wrote {a.json} and {a.plot}")


def plot(rows: list[dict], path: Path) -> None:
    """Two bar panels over the variants (emulated energy per report; memory against FP32, packed where
    pruned), each bar labelled with the variant's finding F1: the points sit too close for a scatter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows][::-1]
    y = range(len(names))
    fig, (ax_e, ax_m) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.5), sharey=True)
    ax_e.barh(y, [r["mj_per_report"] for r in rows][::-1], color="tab:orange")
    ax_m.barh(y, [r["memory_vs_fp32"] for r in rows][::-1], color="lightgrey", label="as stored")
    ax_m.barh(y, [r["memory_compressed_vs_fp32"] for r in rows][::-1], color="tab:blue", label="packed (estimate)")
    for i, r in enumerate(rows[::-1]):
        lo, hi = r["finding_f1_ci95"]
        ax_e.text(r["mj_per_report"], i, f" F1 {r['finding_f1']:.3f} [{lo:.3f}, {hi:.3f}]", va="center", fontsize=7)
    ax_e.set_yticks(list(y), names, fontsize=8)
    ax_e.set_xlabel("emulated X1 energy per report (mJ)")
    ax_m.set_xlabel("weight memory / FP32")
    ax_m.legend(fontsize=7, loc="lower right")
    ax_e.set_xlim(0, max(r["mj_per_report"] for r in rows) * 1.6)
    fig.suptitle("radreport-tiny compression on the X1 (synthetic test split, finding F1 with 95% CI)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
