"""`edgekit engine`: TensorRT engines of an orin bundle on the Jetson. `build` makes and caches them, `check` holds
them to ONNX Runtime and a quality floor, `capability` lists what TensorRT 10.3 would refuse in any ONNX graph.

`build --dry-run`, `check --onnxrt` and `capability` need no TensorRT: they are what can be checked anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from edgekit.cli.options import BundleArgument, JsonOption, StateDirOption, examples
from edgekit.cli.output import emit, err_console, progress

app = typer.Typer(
    help="TensorRT engines for Jetson Orin: build and cache them on the device, check them against ONNX Runtime.",
    no_args_is_help=True,
    epilog=examples(
        "edgekit build --target orin -o out/radreport-tiny-orin --no-parity && edgekit engine check "
        "out/radreport-tiny-orin --onnxrt",
        note="On the Jetson (JetPack 6.x, TensorRT >= 10.3): edgekit engine build BUNDLE, then edgekit engine "
        "check BUNDLE. docs/orin.md says what was verified where.",
    ),
)

ORIN = "out/radreport-tiny-orin"
MAKE_ORIN = f"edgekit build --target orin -o {ORIN} --no-parity && "
DlaOption = Annotated[
    list[str] | None,
    typer.Option("--dla", help="Put this graph (vision_encoder, embed_tokens, decoder) on the DLA; repeatable."),
]
DlaCoreOption = Annotated[int | None, typer.Option("--dla-core", min=0, max=1, help="DLA core (0 or 1) for --dla.")]


@app.callback()
def _engine() -> None:
    """TensorRT engines of orin bundles (docs/orin.md)."""


def _say(as_json: bool):
    def say(msg: str) -> None:
        if not as_json:
            err_console.print(f"[dim]{escape(msg)}[/dim]")

    return say


def _state(state_dir: Path | None) -> str | None:
    """`--state-dir` as the orin library takes it (a string; None: its default, $EDGEKIT_STATE_DIR and on)."""
    return None if state_dir is None else str(state_dir)


def _overrides(
    dla: list[str] | None, dla_core: int | None, workspace: int | None, level: int | None, max_batch: int | None = None
) -> dict:
    out: dict = {}
    if max_batch is not None:
        out["max_batch"] = max_batch
    if dla:
        out["devices"] = dict.fromkeys(dla, "dla")
    if dla_core is not None:
        out["dla_core"] = dla_core
    if workspace is not None:
        out["workspace_mib"] = workspace
    if level is not None:
        out["builder_optimization_level"] = level
    return out


@app.command(
    epilog=examples(
        MAKE_ORIN + f"edgekit engine build {ORIN} --dry-run   # every check that needs no GPU",
        MAKE_ORIN + f"edgekit engine build {ORIN} --dry-run --dla vision_encoder --dla-core 0 --json | jq .capability",
        note="On the Jetson, without --dry-run: builds one engine per graph into the state directory, keyed by "
        "TensorRT version, L4T release, SM and device; an up-to-date cache is reused unless --rebuild.",
    )
)
def build(
    bundle: BundleArgument,
    state_dir: StateDirOption = None,
    rebuild: Annotated[
        bool, typer.Option("--rebuild", help="Build even if the cached engines are up to date.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check and show the plan; build nothing.")] = False,
    dla: DlaOption = None,
    dla_core: DlaCoreOption = None,
    workspace: Annotated[int | None, typer.Option("--workspace-mib", min=16, help="Builder workspace.")] = None,
    level: Annotated[
        int | None, typer.Option("--opt-level", min=0, max=5, help="Builder optimisation level (plan: 3).")
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(
            "--max-batch",
            min=1,
            max=64,
            help="Rows one decode step carries (plan: 8); serve with the run setting max_batch to match.",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Build the bundle's TensorRT engines for this Jetson (strongly typed, the manifest's profiles), cached."""
    from edgekit.bundle import load_bundle
    from edgekit.targets.orin.engine_build import build_engines
    from edgekit.targets.orin.engine_build import dry_run as plan_only

    b = load_bundle(bundle)
    overrides = _overrides(dla, dla_core, workspace, level, max_batch)
    if dry_run:
        emit(plan_only(b, state=_state(state_dir), overrides=overrides), as_json, title="engine build plan (dry run)")
        return
    with progress("building engines", as_json=as_json) as task:

        def step(phase: str, done: int, total: int) -> None:
            task.update(description=phase, completed=done, total=total)

        meta = build_engines(
            b, state=_state(state_dir), overrides=overrides, force=rebuild, progress=step, say=_say(as_json)
        )
    emit(meta, as_json, title="TensorRT engines")


@app.command(
    epilog=examples(
        MAKE_ORIN + f"edgekit engine check {ORIN} --onnxrt --json | jq .passed",
        MAKE_ORIN + f"edgekit engine check {ORIN} --onnxrt --eval data/test --eval-limit 2 --floor 0.5",
        note="On the Jetson, without --onnxrt: the engines against ONNX Runtime on the bundle's reference inputs, "
        "and with --eval their finding F1 against the floor and within 1 point of ONNX Runtime's. Exit 2 when a "
        "gate fails.",
    )
)
def check(
    bundle: BundleArgument,
    onnxrt: Annotated[
        bool, typer.Option("--onnxrt", help="ONNX Runtime only: the bundle's graphs against their stored references.")
    ] = False,
    eval_data: Annotated[
        Path | None, typer.Option("--eval", help="Quality gate on this split (from `edgekit data synth`).")
    ] = None,
    eval_limit: Annotated[int | None, typer.Option(min=1, help="Evaluate only the first N studies.")] = None,
    floor: Annotated[
        float | None, typer.Option("--floor", min=0.0, max=1.0, help="Lowest finding F1 that may serve.")
    ] = None,
    state_dir: StateDirOption = None,
    as_json: JsonOption = False,
) -> None:
    """Hold the engines to ONNX Runtime (as `polygraphy run --trt --onnxrt`) and, with --eval, to a quality floor."""
    from edgekit.bundle import load_bundle
    from edgekit.targets.orin.engine_check import GateFailedError, check_bundle

    b = load_bundle(bundle)
    result = check_bundle(
        b,
        executor="onnxrt" if onnxrt else "tensorrt",
        state=_state(state_dir),
        eval_data=eval_data,
        eval_limit=eval_limit,
        floor=floor,
    )
    if as_json:
        emit(result, True)
    else:
        rows = [{"case": case, **m} for case, m in result["numerics"]["cases"].items()]
        emit(rows, False, title=result["numerics"]["against"])
        if "quality" in result:
            q = result["quality"]
            emit({"split": q["split"], "n": q["n"], "finding F1": q["finding_f1"], "floor": q["floor"]}, False)
    if not result["passed"]:
        raise GateFailedError(f"gate failed: {'; '.join(result['failures'])}", bundle)
    if not as_json:
        err_console.print("passed", markup=False)


@app.command(
    epilog=examples(
        "edgekit engine capability out/radreport-tiny-cpu",
        MAKE_ORIN + f"edgekit engine capability {ORIN} --dla vision_encoder --json | jq '.[0].findings | length'",
        note="Takes an .onnx file, a folder of graphs or a bundle. A node nothing fixes is an error (exit 2); DLA "
        "findings fall back to the GPU.",
    )
)
def capability(
    path: Annotated[Path, typer.Argument(help="An .onnx graph, a folder of them, or a bundle.", show_default=False)],
    dla: DlaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Which nodes TensorRT 10.3 can build (onnx-tensorrt's operator table), like `polygraphy inspect capability`."""
    from edgekit.errors import ConfigError
    from edgekit.targets.orin.capability import check_file, refuse_unsupported

    if path.is_file() and path.suffix == ".onnx":
        files = [path]
    else:
        from edgekit.names import GRAPH_FILES, graph_roles_in
        from edgekit.passes.pipeline import resolve_source

        root = resolve_source(path)
        # a bundle's portable graphs are what TensorRT builds; another target's own graphs beside them (the cpu
        # target's fused decoder) are not: a folder of other graphs is checked whole
        files = [root / GRAPH_FILES[r] for r in graph_roles_in(root)] or sorted(root.glob("*.onnx"))
        if not files:
            raise ConfigError("holds no .onnx graphs", path)
    from edgekit.names import graph_role

    reports = [check_file(f, dla=(graph_role(f.name) or f.stem) in (dla or [])) for f in files]
    if as_json:
        emit([r.to_dict() for r in reports], True)
    else:
        emit(
            [
                {"graph": r.graph, "nodes": r.nodes, "supported": r.supported_nodes, "findings": len(r.findings)}
                for r in reports
            ],
            False,
            title="TensorRT 10.3 capability",
        )
        findings = [f for r in reports for f in r.findings]
        if findings:
            emit(
                [{"graph": f.graph, "node": f.node, "op": f.op, "reason": f.reason, "fix": f.fix} for f in findings],
                False,
            )
    refuse_unsupported(reports, files[0].parent)
