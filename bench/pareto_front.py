"""The default model's energy-quality front: `edgekit pareto` over its cpu and x1 variants, in one run.

Variants: cpu FP32 (the export), cpu INT8, cpu INT4 RTN, cpu INT4 AWQ, and x1 (INT4, compiled) at several DSS
sparsity targets. Each is measured on the same studies of the test split by `edgekit pareto` (one child process
per point). Energy on cpu is the best meter this machine has (here: the CPU-time estimate, labelled so); on x1 it
is the X1 cost model's (emulated), as is x1's latency: the two sources are not the same kind of figure, and the
table and plot say which is which.

The orin bundle (FP16 graphs, as TensorRT would take them) has no device here: its graphs run in ONNX Runtime and
each report is billed by the Orin cost model at a few devices and power modes (`--orin-estimate`, labelled
`estimated:orin-<model>-<mode>`). Those points are another device's, so they get a front of their own
(`<out>-orin/`), never mixed with this machine's.

    python bench/pareto_front.py                 # 60 studies of the test split
    python bench/pareto_front.py --limit 300 --sparsity 0.0 0.25 0.38 0.5
    python bench/pareto_front.py --orin agx-orin-64:MAXN orin-nano-8:7W
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from edgekit.build import build
from edgekit.eval.runner import default_test_split
from edgekit.pareto import read_profile
from edgekit.targets.orin.run_settings import canonical_estimate

CPU_VARIANTS = {"fp32": None, "int8": "int8", "int4-rtn": "int4", "int4-awq": "int4-awq"}
ORIN_MODES = ["agx-orin-64:MAXN", "agx-orin-64:30W", "orin-nano-8:15W"]


def bundles(cache: Path) -> list[Path]:
    """The variants' bundles, built once into `cache` (rebuilt when missing)."""
    out = []
    for name, recipe in [*((f"cpu-{k}", v) for k, v in CPU_VARIANTS.items()), ("x1-int4", None), ("orin-fp16", None)]:
        path = cache / f"radreport-tiny-{name}"
        if not (path / "manifest.json").is_file():
            build(name.split("-")[0], path, parity=False, recipe=recipe)
        out.append(path)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.25, 0.38, 0.5])
    ap.add_argument("--cache", type=Path, default=Path("out/pareto-bundles"))
    ap.add_argument("--out", type=Path, default=Path("out/pareto"))
    ap.add_argument("--orin", nargs="+", default=ORIN_MODES, help="DEVICE:MODE of the Orin estimate points")
    ap.add_argument("--fresh", action="store_true", help="measure every point again")
    args = ap.parse_args()

    t0 = time.perf_counter()
    *paths, orin = bundles(args.cache)
    data = default_test_split()
    common = ["--data", str(data), "--limit", str(args.limit), "--json"] + (["--force"] if args.fresh else [])
    pareto = [sys.executable, "-m", "edgekit.cli.app", "pareto"]
    cmd = [*pareto, *map(str, paths), "-o", str(args.out), *common, *(f"--sparsity-target={s}" for s in args.sparsity)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    orin_out = args.out.with_name(args.out.name + "-orin")
    cmd = [*pareto, str(orin), "-o", str(orin_out), *common, *(f"--orin-estimate={m}" for m in args.orin)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    front, rows, split = show(read_profile(args.out / "pareto.json"), "radreport-tiny front (this machine, x1)")
    orin_profile = read_profile(orin_out / "pareto.json")
    first = next(p for p in orin_profile.points if p.settings.get("orin_estimate") == canonical_estimate(args.orin[0]))
    orin_front, orin_rows, _ = show(orin_profile, "radreport-tiny on Orin (estimated)", reference=first)
    result = {
        "split": split,
        "points": rows,
        "front": sorted(front),
        "orin": {"points": orin_rows, "front": sorted(orin_front), "plot": str(orin_out / "pareto.png")},
        "wall_s": round(time.perf_counter() - t0, 1),
        "plot": [str(args.out / "pareto.png"), str(args.out / "pareto.svg")],
        "note": "ratios only between points whose energy has the same source; the Orin points are estimates "
        "(edgekit's Orin cost model, not measured on a device) and have a front of their own",
    }
    out = Path("out/pareto_front.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}; plots {args.out / 'pareto.png'}, {orin_out / 'pareto.png'}; {len(front)} non-dominated points")
    return 0 if len(front) >= 4 else 1


def show(profile, title: str, reference=None) -> tuple[set[str], list[dict], dict]:
    """Print a profile's table; its front and rows. Energy ratios are to `reference` (default: the best-F1 point)
    and only between figures of one model: the same source, or the Orin cost model at any device and mode."""
    front = {p.id for p in profile.front}
    best = reference or max(profile.points, key=lambda p: p.f1)
    table = Table(title=f"{title}: {len(front)} of {len(profile.points)} points non-dominated")
    vs = "vs best F1 J" if reference is None else f"vs {best.settings.get('orin_estimate', best.id)} J"
    for col in ("point", "front", "F1 [95% CI]", "p95 ms", "latency src", "J/report", "energy src", vs):
        table.add_column(col)
    rows = []
    for p in sorted(profile.points, key=lambda p: p.energy_j):
        lo, hi = p.f1_ci
        orin = all(x.startswith("estimated:orin-") for x in (p.energy_source, best.energy_source))
        ratio = p.energy_j / best.energy_j if orin or p.energy_source == best.energy_source else None
        rows.append({**p.to_dict(), "front": p.id in front, "energy_vs_reference": ratio, "reference": best.id})
        table.add_row(
            p.id, "*" if p.id in front else "", f"{p.f1:.3f} [{lo:.3f}, {hi:.3f}]", f"{p.latency_p95_ms:.0f}",
            p.latency_source, f"{p.energy_j:.3g}", p.energy_source, f"{ratio:.2f}x" if ratio else "-",
        )  # fmt: skip
    Console().print(table)
    return front, rows, profile.split


if __name__ == "__main__":
    sys.exit(main())
