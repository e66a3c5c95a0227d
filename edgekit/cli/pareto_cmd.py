"""`edgekit pareto`: every variant x knob measured on an eval split, the energy-quality-latency front of each
device, a plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from edgekit.cli.claims import writable_out
from edgekit.cli.options import JsonOption, examples
from edgekit.cli.output import console, emit, progress
from edgekit.pareto.configs import DEFAULT_GRID, describe_default_grid

app = typer.Typer(help="Profile variants: energy, quality and latency, and their Pareto front.")

GRID_HELP = "Repeat to vary it: each value is one configuration per bundle."
ORIN_ESTIMATE_HELP = (
    "Orin bundles only: bill each report by the Orin cost model for this device and power mode (e.g. "
    "agx-orin-64:MAXN, orin-nano-8:15W), the graphs run in ONNX Runtime. Repeat for more devices or modes: each is "
    "a front of its own, and not a knob flag (the default grid still applies)."
)
KNOB_HELP = (
    "Any knob of these bundles' targets, by name: the core's (max_new_tokens, video_max_frames, threads, max_batch) "
    "or one a "
    "target's plug-in declares (x1's sparsity_target, orin's orin_estimate, an out-of-tree target's own). "
    f"{GRID_HELP} The same as its named flag where there is one."
)


def _default(knob: str) -> str:
    values, targets = DEFAULT_GRID[knob]
    return ", ".join(map(str, values)) + (f" on {', '.join(targets)}" if targets else "") + ", beside the bundle's own"


DEFAULT_GRID_NOTE = (
    "With no knob flag (--max-new-tokens, --video-max-frames, --sparsity-target, --threads, --max-batch, --knob), "
    "each bundle is "
    "measured at its own settings and then at each value of the default grid, one knob at a time: "
    + describe_default_grid()
    + ". --no-default-grid: one point per bundle. Each device has a front of its own (the X1's emulated figures, "
    "an Orin estimate per device and mode, this machine's wall clock and meter): figures from different sources "
    "are never ranked together."
)


def _rows(front) -> list[dict]:
    on = {p.id for p in front.front}
    rows = []
    for p in sorted(front.points, key=lambda p: (p.energy_j if math.isfinite(p.energy_j) else math.inf, -p.f1)):
        lo, hi = p.f1_ci
        rows.append(
            {
                "point": p.id,
                "front": "*" if p.id in on else "",
                "target": p.target,
                "F1 [95% CI]": f"{p.f1:.3f} [{lo:.3f}, {hi:.3f}]",
                "halluc.": f"{p.hallucination_rate:.3f}",
                "p50 / p95 ms": f"{p.latency_p50_ms:.3g} / {p.latency_p95_ms:.3g}",
                "J / report": f"{p.energy_j:.3g}",
                "W": f"{p.power_w:.3g}",
                "peak MiB": f"{p.peak_rss_mib:.0f}",
                "n": p.count,
            }
        )
    return rows


@app.command(
    epilog=examples(
        "edgekit pareto out/radreport-tiny-cpu out/radreport-tiny-x1 -o out/pareto --data data/test --limit 2  "
        "# the default grid: two fronts",
        "edgekit pareto out/radreport-tiny-x1 -o out/pareto-dss --data data/test --limit 2 --sparsity-target 0.2 "
        "--sparsity-target 0.5",
        "edgekit pareto out/radreport-tiny-cpu -o out/pareto-cpu --data data/test --limit 4 --no-default-grid --json",
        "edgekit pareto out/radreport-tiny-x1 -o out/pareto-batch --data data/test --limit 8 --max-batch 1 "
        "--max-batch 8",
        "edgekit pareto out/radreport-tiny-x1 -o out/pareto-knob --data data/test --limit 2 --knob sparsity_target=0.5 "
        "--knob max_new_tokens=24",
        "edgekit build --target orin -o out/radreport-tiny-orin --no-parity --force && edgekit pareto "
        "out/radreport-tiny-orin -o out/pareto-orin --data data/test --limit 2 --orin-estimate agx-orin-64:MAXN "
        "--orin-estimate orin-nano-8:15W --no-default-grid",
        note=DEFAULT_GRID_NOTE + " Run again with the same -o to resume: points already measured (same id, same "
        "bundle) are kept. Without --data: the default model family's test split, generated once into the cache. "
        "Writes pareto.json (its fronts are what edgekitd's [policy] reads) and pareto.png / pareto.svg, a panel "
        "per front. --orin-estimate runs an orin bundle's graphs in ONNX Runtime and bills each report by the "
        "Orin cost model: estimated figures, labelled estimated:orin-<model>-<mode>, a front per device and mode.",
    )
)
def pareto(
    bundles: Annotated[list[Path], typer.Argument(help="Bundles (directories or .ekb files): the variants.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile folder (resumed if it holds a pareto.json).")],
    data: Annotated[
        Path | None, typer.Option(help="Eval split (`edgekit data synth`); default: the test split.")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N studies of the split.")] = None,
    max_new_tokens: Annotated[
        list[int] | None,
        typer.Option(min=1, help=f"Caps on report length. {GRID_HELP} Default grid: {_default('max_new_tokens')}."),
    ] = None,
    video_max_frames: Annotated[
        list[int] | None,
        typer.Option(
            min=1,
            help="Frames sampled per video clip; below the model's own count (8) the encoder sees fewer: frame "
            f"skipping. {GRID_HELP} Default grid: {_default('video_max_frames')}.",
        ),
    ] = None,
    sparsity_target: Annotated[
        list[float] | None,
        typer.Option(
            min=0.0,
            max=0.95,
            help=f"X1 DSS sparsity targets (x1 only). {GRID_HELP} Default grid: {_default('sparsity_target')}.",
        ),
    ] = None,
    threads: Annotated[
        list[int] | None, typer.Option(min=1, help=f"Threads. {GRID_HELP} Default grid: {_default('threads')}.")
    ] = None,
    max_batch: Annotated[
        list[int] | None,
        typer.Option(
            min=1,
            help="Reports in flight at once: the split is reported this many at a time and decoded together (energy "
            f"per report at a full batch; edgekitd caps its rows at the served point's). {GRID_HELP} Default grid: "
            f"{_default('max_batch')}.",
        ),
    ] = None,
    knob: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME=VALUE",
            help=KNOB_HELP,
        ),
    ] = None,
    orin_estimate: Annotated[list[str] | None, typer.Option(metavar="DEVICE:MODE", help=ORIN_ESTIMATE_HELP)] = None,
    meter: Annotated[
        str | None, typer.Option(help="Energy meter for non-emulated targets (default: the best this machine has).")
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Measure every point again, replacing the profile in --out (default: resume)."),
    ] = False,
    default_grid: Annotated[
        bool,
        typer.Option(
            help="Without knob flags, measure the default grid (see below); --no-default-grid: one point per bundle."
        ),
    ] = True,
    plot: Annotated[bool, typer.Option(help="Write pareto.png and pareto.svg (a panel per front).")] = True,
    as_json: JsonOption = False,
) -> None:
    """Measure latency p50/p95, energy per report (with its source), peak memory, finding F1 with 95% CI and the
    hallucination rate of every configuration, and write the non-dominated front over energy x F1 x latency of
    each device: points whose energy or latency come from different sources are on different fronts."""
    from edgekit.bundle import load_bundle
    from edgekit.pareto.energy import describe_meter
    from edgekit.pareto.run import PROFILE_NAME

    writable_out(out / PROFILE_NAME)
    loaded = [load_bundle(b) for b in bundles]  # every bundle checked before the first point is measured
    named: dict[str, list[Any] | None] = {
        "max_new_tokens": max_new_tokens,
        "video_max_frames": video_max_frames,
        "sparsity_target": sparsity_target,
        "threads": threads,
        "max_batch": max_batch,
        "orin_estimate": orin_estimate,
    }
    configs, grid = _plan(loaded, named, knob, use_default=default_grid)
    data_dir, split = _split(data, limit)
    meter_info = describe_meter(meter)
    profile = _measure(configs, out, data_dir, split, limit, meter_info, grid, resume=not force, as_json=as_json)
    _report(profile, out, split, meter_info, plot=plot, as_json=as_json)


def _plan(loaded: list, named: dict[str, list[Any] | None], knob: list[str] | None, *, use_default: bool):
    """The configurations to measure: the named knob flags and `--knob`'s merged, orin estimates checked."""
    from edgekit.pareto.configs import plan
    from edgekit.pareto.knob_flags import merge_knobs, parse_knob_flags

    knobs = merge_knobs(named, parse_knob_flags(knob, sorted({b.target for b in loaded})))
    knobs["orin_estimate"] = _orin_estimates(loaded, knobs.get("orin_estimate"))
    if knobs["orin_estimate"] and any((v or 1) > 1 for v in knobs.get("max_batch") or ()):
        from edgekit.errors import ConfigError

        raise ConfigError(
            "--max-batch above 1 with --orin-estimate: the Orin cost model bills each report as if alone, so a "
            "batch's power and drain would be wrong; sweep the batch size without an estimate, or on cpu or x1"
        )
    return plan(loaded, knobs, use_default=use_default)


def _orin_estimates(bundles: list, estimates: list[Any] | None) -> list[Any] | None:
    """`--orin-estimate`, each in the cost model's spelling; checked here, not in each point's process, so a bad
    one is one line listing the devices and modes."""
    if not estimates:
        return estimates
    from edgekit.errors import ConfigError
    from edgekit.targets.orin.run_settings import canonical_estimate

    if not any(b.target == "orin" for b in bundles):
        raise ConfigError("--orin-estimate applies to orin bundles, and none of these is one")
    return [canonical_estimate(v) for v in estimates]


def _split(data: Path | None, limit: int | None) -> tuple[Path, dict]:
    """The eval split's folder (`--data`, else the default test split) and what pareto.json records about it."""
    from edgekit.eval.runner import default_test_split, load_split

    data_dir = data if data is not None else default_test_split()
    studies = load_split(data_dir)
    split = {"name": data_dir.name if data is not None else "test", "count": min(limit or len(studies), len(studies))}
    split["source"] = str(data_dir)
    return data_dir, split


def _measure(
    configs: list,
    out: Path,
    data_dir: Path,
    split: dict,
    limit: int | None,
    meter: dict,
    grid: dict,
    *,
    resume: bool,
    as_json: bool,
):
    """Every configuration measured (or kept from the profile in `out` when `resume`), a bar advancing per point."""
    from edgekit.pareto.run import run_pareto

    out.mkdir(parents=True, exist_ok=True)
    with progress("points", total=len(configs), as_json=as_json) as task:
        return run_pareto(
            configs,
            out,
            data_dir,
            split=split,
            limit=limit,
            meter=meter["name"],
            meters=[meter],
            resume=resume,
            on_point=lambda _c, _reused: task.advance(),
            grid=grid,
        )


def _report(profile, out: Path, split: dict, meter: dict, *, plot: bool, as_json: bool) -> None:
    """The plots written (with `plot`), then the profile and its files: JSON, or a table per front."""
    from edgekit.pareto.plot import plot_profile
    from edgekit.pareto.run import PROFILE_NAME

    images = plot_profile(profile, out / "pareto") if plot else []
    files = [out / PROFILE_NAME, *images]
    if as_json:
        emit({**profile.to_dict(), "files": [str(f) for f in files]}, True)
        return
    _show(profile, f"{split['name']} split, {split['count']} studies", meter["description"], files)


def _show(profile, split: str, meter: str, files: list[Path]) -> None:
    """A table per front, titled with its device and sources, then what was varied and where it was written."""
    from edgekit.pareto.configs import describe_grid

    fronts = profile.fronts
    for i, front in enumerate(fronts, 1):
        title = f"front {i} of {len(fronts)}: {front.label}; {len(front.points)} points, {len(front.front)} on it (*)"
        emit(_rows(front), False, title=escape(title))
    wrote = ", ".join([str(files[0]), *(f.name for f in files[1:])])
    line = (
        f"{describe_grid(profile.grid)}. {split}; energy meter for host-timed targets: {meter}; fronts are never "
        f"compared with each other; wrote {wrote}"
    )
    console.print("[dim]" + escape(line) + "[/dim]")
