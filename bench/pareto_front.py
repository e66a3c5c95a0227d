"""The default model's energy-quality front: `edgekit pareto` over its x1, cpu and orin variants, in one run.

x1 (the main front: one energy source, the X1 cost model, `emulated:x1`): FP16, INT8, INT4, INT4 + 2:4 sparsity,
INT4 with 38% of heads pruned, INT4 at several DSS sparsity targets and report-length caps (`--caps`), and INT4 and
heads38 with video frame skipping (`--frames`: video_max_frames below the model's 8), and INT4 with the split
reported several at a time and decoded together (`--batches`: max_batch). cpu (a front of its own: energy is this
machine's best meter, here the CPU-time estimate): FP32, INT8, INT4 RTN, INT4 AWQ, and FP32 at the same caps,
frames and batches. Each is measured on the same studies of the test split (one child process per point), F1 on
its DICOM studies and video F1 on its cine clips. Fronts are never mixed across energy sources, and points equal
on energy, F1, video F1 and latency count once ("distinct"). A cached bundle built from other weights or by
other edgekit code is rebuilt.

The orin bundle (FP16 graphs, as TensorRT would take them) has no device here: its graphs run in ONNX Runtime and
each report is billed by the Orin cost model at a few devices and power modes (`--orin-estimate`, labelled
`estimated:orin-<model>-<mode>`). Those points are another device's, so they get a front of their own
(`<out>-orin/`), never mixed with this machine's.

    python bench/pareto_front.py                 # 120 studies of the test split
    python bench/pareto_front.py --limit 240 --sparsity 0.0 0.5 --frames 4 --caps 16 24 32   # README's row
    python bench/pareto_front.py --x1-only --limit 60 --sparsity 0.0 0.25 0.38 0.5
    python bench/pareto_front.py --orin agx-orin-64:MAXN orin-nano-8:7W
    python bench/pareto_front.py --limit 120 --sparsity 0.5 --frames --batches 4 8 --out out/pareto-batch
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgekit.build import build, default_model_dir
from edgekit.eval.runner import default_test_split
from edgekit.pareto import read_profile
from edgekit.pareto.plot import plot_profile
from edgekit.targets.orin.run_settings import canonical_estimate

CPU_VARIANTS = {"fp32": None, "int8": "int8", "int4-rtn": "int4", "int4-awq": "int4-awq"}
X1_VARIANTS = {
    "fp16": "fp16",
    "int8": "int8",
    "int4": None,
    "int4-sparse24": "int4-sparse24",
    "int4-heads38": "int4-heads38",
}
ORIN_MODES = ["agx-orin-64:MAXN", "agx-orin-64:30W", "orin-nano-8:15W"]


@functools.cache  # one walk over the package per run, not one per bundle
def edgekit_code_sha256() -> str:
    """One hash of the installed edgekit's Python files, its core and the packages installed under its namespace
    (targets, models, daemon; an editable install keeps those outside `edgekit/`): a cached bundle built by other
    code (a pass's default changed, say) is not the bundle this code would build."""
    import hashlib
    import importlib.util

    files: dict[Path, str] = {}
    for package in ("edgekit", "edgekit.targets", "edgekit.models", "edgekit.daemon"):
        spec = importlib.util.find_spec(package)
        for root in map(Path, (spec and spec.submodule_search_locations) or []):
            for path in root.rglob("*.py"):
                files.setdefault(path.resolve(), f"{package}/{path.relative_to(root)}")
    digest = hashlib.sha256()
    for path, label in sorted(files.items(), key=lambda item: item[1]):
        digest.update(label.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def fresh_bundle(target: str, path: Path, recipe: str | None) -> Path:
    """`path`, built for `target` with `recipe` unless it holds a bundle of the current default weights built by
    this code (a cache from before a retrain or a pass change would otherwise be measured as if it were current).
    The code's hash sits beside the bundle (`PATH.code-sha256`), outside its checksummed files."""
    from edgekit.bundle import load_bundle, sha256_file
    from edgekit.errors import BundleError

    weights = default_model_dir() / "model.safetensors"
    stamp = path.with_name(path.name + ".code-sha256")
    code = edgekit_code_sha256()
    if (path / "manifest.json").is_file():
        try:
            same_weights = load_bundle(path).manifest.provenance.get("source_weights_sha256") == sha256_file(weights)
            if same_weights and stamp.is_file() and stamp.read_text().strip() == code:
                return path
        except BundleError:
            pass
        print(f"{path}: built from other weights or by other edgekit code; rebuilding")
    build(target, path, parity=False, recipe=recipe)
    stamp.write_text(code + "\n")
    return path


def bundles(cache: Path, x1_only: bool = False) -> dict[str, list[Path]]:
    """The variants' bundles by target, built once into `cache` (see `fresh_bundle`)."""
    wanted = {
        "cpu": [(f"cpu-{k}", v) for k, v in CPU_VARIANTS.items()],
        "x1": [(f"x1-{k}", v) for k, v in X1_VARIANTS.items()],
        "orin": [("orin-fp16", None)],
    }
    out: dict[str, list[Path]] = {}
    for target, items in wanted.items():
        if x1_only and target != "x1":
            continue
        for name, recipe in items:
            out.setdefault(target, []).append(fresh_bundle(target, cache / f"radreport-tiny-{name}", recipe))
    return out


def profile_x1(
    paths: list[Path],
    out: Path,
    data: Path,
    limit: int,
    sparsity: list[float],
    fresh: bool,
    frames: list[int] = (),
    caps: list[int] = (),
    batches: list[int] = (),
):
    """Every x1 variant at its own DSS setting, and the INT4 one at each DSS target and report-length cap, INT4
    and INT4-heads38 at each video frame count (frame skipping); one energy source, the X1 cost model. Through
    `edgekit pareto`'s library, which lets grids differ per bundle."""
    from edgekit.bundle import load_bundle
    from edgekit.pareto.configs import expand
    from edgekit.pareto.run import run_pareto

    loaded = [load_bundle(p) for p in paths]
    int4 = next(b for b in loaded if Path(b.source).name.endswith("x1-int4"))
    configs = expand(loaded, {}) + expand([int4], {"sparsity_target": sparsity})
    heads = [b for b in loaded if Path(b.source).name.endswith("x1-int4-heads38")]
    configs += expand([int4, *heads], {"video_max_frames": list(frames)}) if frames else []
    configs += expand([int4], {"max_new_tokens": list(caps)}) if caps else []
    configs += expand([int4], {"max_batch": list(batches)}) if batches else []
    run_pareto(configs, out, data, split={"name": "test", "count": limit}, limit=limit, resume=not fresh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--frames", type=int, nargs="*", default=[4], help="video_max_frames of INT4 points (skipping)")
    ap.add_argument("--caps", type=int, nargs="*", default=[], help="max_new_tokens of INT4 points")
    ap.add_argument("--batches", type=int, nargs="*", default=[], help="max_batch of INT4 (x1) and FP32 (cpu) points")
    ap.add_argument("--x1-only", action="store_true", help="skip the cpu and orin fronts")
    ap.add_argument("--cache", type=Path, default=Path("out/pareto-bundles"))
    ap.add_argument("--out", type=Path, default=Path("out/pareto"))
    ap.add_argument("--orin", nargs="+", default=ORIN_MODES, help="DEVICE:MODE of the Orin estimate points")
    ap.add_argument("--fresh", action="store_true", help="measure every point again")
    args = ap.parse_args()

    t0 = time.perf_counter()
    paths = bundles(args.cache, x1_only=args.x1_only)
    data = default_test_split()
    profile_x1(paths["x1"], args.out, data, args.limit, args.sparsity, args.fresh, args.frames, args.caps, args.batches)
    x1_profile = read_profile(args.out / "pareto.json")
    plot_profile(x1_profile, args.out / "pareto")
    front, rows, split = show(x1_profile, "radreport-tiny on the X1 (emulated)")
    distinct = distinct_front(x1_profile)
    result = {
        "split": split,
        "points": rows,
        "front": sorted(front),
        "distinct_front_points": len(distinct),
        "wall_s": None,
        "plot": [str(args.out / "pareto.png"), str(args.out / "pareto.svg")],
        "note": "ratios only between points whose energy has the same source; the Orin points are estimates "
        "(edgekit's Orin cost model, not measured on a device) and have a front of their own; F1 is the DICOM "
        "studies', video F1 the clips' (compared on the front where both points have it)",
    }
    if not args.x1_only:
        result.update(other_fronts(paths, args, data))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path("out/pareto_front.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}; plot {args.out / 'pareto.png'}; {len(front)} non-dominated x1 points")
    print(f"x1 front: {len(distinct)} distinct points (points equal on energy, F1, video F1 and latency count once)")
    if "cpu" in result:
        print(f"cpu front: {result['cpu']['distinct_front_points']} distinct points")
    return 0 if len(distinct) >= 4 else 1


def distinct_front(profile) -> set[tuple]:
    return {
        (round(p.energy_j, 9), round(p.f1, 6), None if p.video_f1 is None else round(p.video_f1, 6),
         round(p.latency_p95_ms, 3))
        for p in profile.front
    }  # fmt: skip


def other_fronts(paths: dict[str, list[Path]], args, data: Path) -> dict:
    """The cpu front (its variants through the `edgekit pareto` CLI, then FP32's frame and cap points through
    the library into the same profile) and the Orin estimate's."""
    from edgekit.bundle import load_bundle
    from edgekit.pareto.configs import expand
    from edgekit.pareto.energy import describe_meter
    from edgekit.pareto.run import run_pareto

    common = ["--data", str(data), "--limit", str(args.limit), "--json", "--no-default-grid"]
    common += ["--force"] if args.fresh else []
    pareto = [sys.executable, "-m", "edgekit.cli.app", "pareto"]
    cpu_out = args.out.with_name(args.out.name + "-cpu")
    subprocess.run(
        [*pareto, *map(str, paths["cpu"]), "-o", str(cpu_out), *common], check=True, stdout=subprocess.DEVNULL
    )
    loaded = [load_bundle(p) for p in paths["cpu"]]
    fp32 = next(b for b in loaded if Path(b.source).name.endswith("cpu-fp32"))
    configs = expand(loaded, {})
    configs += expand([fp32], {"video_max_frames": list(args.frames)}) if args.frames else []
    configs += expand([fp32], {"max_new_tokens": list(args.caps)}) if args.caps else []
    configs += expand([fp32], {"max_batch": list(args.batches)}) if args.batches else []
    meter = describe_meter(None)  # what the CLI chose for the variants' points: this machine's best
    cpu_profile = run_pareto(configs, cpu_out, data, split={"name": "test", "count": args.limit}, limit=args.limit,
                             meter=meter["name"], meters=[meter])  # fmt: skip
    plot_profile(cpu_profile, cpu_out / "pareto")
    orin_out = args.out.with_name(args.out.name + "-orin")
    cmd = [*pareto, *map(str, paths["orin"]), "-o", str(orin_out), *common]
    subprocess.run([*cmd, *(f"--orin-estimate={m}" for m in args.orin)], check=True, stdout=subprocess.DEVNULL)
    cpu_front, cpu_rows, _ = show(cpu_profile, "radreport-tiny on this machine's CPU")
    orin_profile = read_profile(orin_out / "pareto.json")
    first = next(p for p in orin_profile.points if p.settings.get("orin_estimate") == canonical_estimate(args.orin[0]))
    orin_front, orin_rows, _ = show(orin_profile, "radreport-tiny on Orin (estimated)", reference=first)
    return {
        "cpu": {
            "points": cpu_rows,
            "front": sorted(cpu_front),
            "distinct_front_points": len(distinct_front(cpu_profile)),
            "plot": str(cpu_out / "pareto.png"),
        },
        "orin": {"points": orin_rows, "front": sorted(orin_front), "plot": str(orin_out / "pareto.png")},
    }


def show(profile, title: str, reference=None) -> tuple[set[str], list[dict], dict]:
    """Print a profile's table; its front and rows. Energy ratios are to `reference` (default: the best-F1 point)
    and only between figures of one model: the same source, or the Orin cost model at any device and mode."""
    front = {p.id for p in profile.front}
    best = reference or max(profile.points, key=lambda p: p.f1)
    table = Table(title=f"{title}: {len(front)} of {len(profile.points)} points non-dominated")
    vs = "vs best F1 J" if reference is None else f"vs {best.settings.get('orin_estimate', best.id)} J"
    cols = ("point", "front", "F1 [95% CI]", "video F1", "p95 ms", "latency src", "J/report", "W", "energy src", vs)
    for col in cols:
        table.add_column(col)
    rows = []
    for p in sorted(profile.points, key=lambda p: p.energy_j):
        lo, hi = p.f1_ci
        orin = all(x.startswith("estimated:orin-") for x in (p.energy_source, best.energy_source))
        ratio = p.energy_j / best.energy_j if orin or p.energy_source == best.energy_source else None
        rows.append({**p.to_dict(), "front": p.id in front, "energy_vs_reference": ratio, "reference": best.id})
        table.add_row(
            escape(p.id), "*" if p.id in front else "", f"{p.f1:.3f} [{lo:.3f}, {hi:.3f}]",
            "-" if p.video_f1 is None else f"{p.video_f1:.3f}", f"{p.latency_p95_ms:.3g}",
            p.latency_source, f"{p.energy_j:.4g}", f"{p.power_w:.3g}", p.energy_source,
            f"{ratio:.3f}x" if ratio else "-",
        )  # fmt: skip
    Console(width=200).print(table)
    return front, rows, profile.split


if __name__ == "__main__":
    sys.exit(main())
