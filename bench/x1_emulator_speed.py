"""X1 emulator vs ONNX Runtime on the same INT4 bundle, side by side: wall time per report (the issue's <= 2x),
greedy report identity, compile time, and the emulated time and energy per report.

    python bench/x1_emulator_speed.py [--model-dir DIR] [--studies 4] [--rounds 3] [--json out/x1_emulator_speed.json]

Three sides when the emulator's C kernels are built (targets/x1/_native.c): `cpu` (ORT), `x1` (the emulator as
it ships) and `x1-numpy` (the same emulator with the C kernels switched off, i.e. what an install without a C
compiler gets). The last two must write identical reports: the kernels are bit-identical by design.

Without --model-dir it uses the committed radreport-tiny weights when present, else a random-weights model of
radreport-tiny's real architecture (`write_tiny_model(full_size=True)`): timing is what this bench is for.
The cpu side runs the very INT4 graphs the x1 programs were compiled from (blocked DequantizeLinear in ORT).
The machine it runs on is usually shared and noisy: every report is timed on both sides back to back (the side
that goes first alternates), `--rounds` times, and the figures are medians (per side, and of the per-report
ratios), with the means alongside. Both sides get one warm-up report; on x1 that also fills the emulator's
per-shape cost tables and its memo of input-determined steps (causal mask, RoPE tables), which later reports
with the same positions replay, as a long-running process would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--studies", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="times each study is reported on each side")
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads (the emulator is single-threaded)")
    ap.add_argument("--json", type=Path, default=Path("out/x1_emulator_speed.json"))
    args = ap.parse_args()

    from edgekit.build import build, default_model_dir
    from edgekit.bundle import ROLES, load_bundle, write_bundle
    from edgekit.models.synth import write_split
    from edgekit.reporter import Reporter

    tmp = Path(tempfile.mkdtemp(prefix="x1-speed-"))
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = default_model_dir()
        if not (model_dir / "model.safetensors").is_file():
            from edgekit.daemon.testing import write_tiny_model

            model_dir = write_tiny_model(tmp / "model", full_size=True, max_new_tokens=48)
    t0 = time.perf_counter()
    x1_path = build("x1", tmp / "x1", model_dir=model_dir, parity=False).bundle
    build_s = time.perf_counter() - t0
    x1 = load_bundle(x1_path)
    cpu_path = write_bundle(tmp / "cpu", {r: x1.component(r) for r in ROLES}, name=x1.name, target="cpu")
    write_split(tmp / "data", "test", args.studies)
    studies = [json.loads(line) for line in (tmp / "data" / "studies.jsonl").read_text().splitlines()]

    from edgekit.targets.x1.kernels import native

    sides = [("cpu", cpu_path), ("x1", x1_path)] + ([("x1-numpy", x1_path)] if native.available else [])
    reporters = {}
    for target, path in sides:
        kw = {"threads": args.threads} if target == "cpu" else {}
        rep = reporters[target] = Reporter.from_bundle(path, **kw)
        native.set(native.available and target == "x1")
        rep.report(tmp / "data" / studies[0]["path"])  # warm-up (first-call allocations)
    x1_cost = {"ms": 0.0, "mj": 0.0}  # emulated, summed over the first round's reports
    names = [t for t, _ in sides]
    texts: dict[str, list[str]] = {t: [] for t in names}
    walls: dict[str, list[float]] = {t: [] for t in names}
    ratios: list[float] = []
    numpy_ratios: list[float] = []
    stable = True
    for rnd in range(args.rounds):
        for i, s in enumerate(studies):
            shift = (rnd + i) % len(names)  # every side goes first, middle and last in turn
            order = names[shift:] + names[:shift]
            pair = {}
            for target in order:
                native.set(native.available and target == "x1")
                t = time.perf_counter()
                r = reporters[target].report(tmp / "data" / s["path"])
                pair[target] = time.perf_counter() - t
                if rnd == 0:
                    texts[target].append(r.text)
                    if target == "x1":
                        x1_cost["ms"] += r.cost["emulated_ms_total"]
                        x1_cost["mj"] += r.cost["mj_total"]
                else:
                    stable &= r.text == texts[target][i]
            for target in pair:
                walls[target].append(pair[target])
            ratios.append(pair["x1"] / pair["cpu"])
            if "x1-numpy" in pair:
                numpy_ratios.append(pair["x1-numpy"] / pair["cpu"])
        if rnd == 0:
            emulated = {"ms": x1_cost["ms"] / len(studies), "mj": x1_cost["mj"] / len(studies)}
    native.set(native.available)
    identical = sum(a == b for a, b in zip(texts["cpu"], texts["x1"]))
    native_same = texts["x1"] == texts["x1-numpy"] if "x1-numpy" in texts else None
    wall = {t: statistics.median(walls[t]) for t in walls}
    mean = {t: statistics.fmean(walls[t]) for t in walls}
    ratio = statistics.median(ratios)
    fig = x1.manifest.figures["x1_compile"]
    summary = {
        "model": str(model_dir),
        "studies": len(studies),
        "rounds": args.rounds,
        "ort_threads": args.threads,
        "wall_ms_per_report": {t: round(v * 1e3, 2) for t, v in wall.items()},
        "wall_ms_per_report_mean": {t: round(v * 1e3, 2) for t, v in mean.items()},
        "emulator_vs_ort_ratio": round(ratio, 3),
        "emulator_vs_ort_ratio_of_medians": round(wall["x1"] / wall["cpu"], 3),
        "emulator_vs_ort_ratio_of_means": round(mean["x1"] / mean["cpu"], 3),
        "per_report_ratios": [round(r, 3) for r in ratios],
        "native_kernels": native.available,
        "numpy_kernels_vs_ort_ratio": round(statistics.median(numpy_ratios), 3) if numpy_ratios else None,
        "native_and_numpy_reports_identical": native_same,
        "greedy_reports_identical": f"{identical}/{len(studies)}",
        "reports_stable_across_rounds": stable,
        "compile_seconds": fig["compile_seconds"],
        "build_seconds": round(build_s, 2),
        "program_bytes": fig["program_bytes"],
        "machine_hash": fig["machine_hash"],
        "emulated_ms_per_report": round(emulated["ms"], 4),
        "emulated_mj_per_report": round(emulated["mj"], 4),
    }
    print(f"{'target':8} {'median ms/report':>17} {'mean ms/report':>15}")
    for t in names:
        print(f"{t:8} {wall[t] * 1e3:17.1f} {mean[t] * 1e3:15.1f}")
    print(
        f"emulator / ORT wall ratio: {ratio:.2f}x (median of {len(ratios)} side-by-side reports; of means "
        f"{summary['emulator_vs_ort_ratio_of_means']:.2f}x)   greedy identical: {identical}/{len(studies)}   "
        f"compile: {fig['compile_seconds']:.2f} s   emulated: {summary['emulated_ms_per_report']:.3f} ms, "
        f"{summary['emulated_mj_per_report']:.3f} mJ per report"
    )
    if numpy_ratios:
        print(
            f"without the C kernels: {summary['numpy_kernels_vs_ort_ratio']:.2f}x ORT; reports identical with and "
            f"without them: {native_same}"
        )
    elif not native.available:
        print("the emulator's C kernels are not built (no C compiler at install time): numpy kernels only")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**summary, "texts": texts}, indent=2))


if __name__ == "__main__":
    main()
