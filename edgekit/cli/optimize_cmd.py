"""`edgekit optimize`: apply graph passes (quantization, FP16, sparsity, LoRA merge) to a model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.options import ForceOption, JsonOption, examples, out_option
from edgekit.cli.output import emit, err_console, progress
from edgekit.errors import ConfigError

app = typer.Typer(help="Apply optimisation passes (quantisation, fusion) to ONNX graphs.")


@app.command(
    epilog=examples(
        "edgekit optimize out/radreport-tiny-cpu -o out/int4 --pass int4",
        "edgekit optimize out/radreport-tiny-cpu -o out/int4-awq --pass 'int4:block=32,method=awq,mixed=1' --calib 4",
        "edgekit optimize out/radreport-tiny-cpu -o out/int4-orin --pass int4:target=orin",
        "edgekit optimize out/radreport-tiny-cpu -o out/int8 --recipe int8 --json",
        "edgekit optimize out/radreport-tiny-cpu -o out/fp16 --recipe models/radreport_tiny/recipes/fp16.toml",
        "edgekit optimize out/radreport-tiny-cpu/decoder_model_merged.onnx -o out/decoder-int4.onnx "
        "--pass int4:block=32,method=rtn --dim seq=64",
        note="SOURCE is a folder of ONNX graphs (from edgekit convert), a bundle, any ONNX file, or a folder of "
        "ONNX files. On a file edgekit did not write, unnamed nodes are named, external data is kept (OUT.data), "
        "the opset is raised where a pass needs it, and each pass is checked against the model before it on "
        "feeds generated from the graph's inputs (symbolic dims by name; --dim NAME=N sets one). lora and heads "
        "need edgekit's graph roles and are refused on such files. A bundled recipe is named without its .toml: "
        "fp16, int8, int4, int4-awq, int4-orin, int4-heads38, int4-sparse24.",
    )
)
def optimize(
    source: Annotated[
        Path,
        typer.Argument(
            help="Model directory (the three ONNX graphs), bundle (dir or .ekb), an ONNX file or a folder of them.",
            show_default=False,
        ),
    ],
    out: Annotated[Path, out_option("Output model directory, or .onnx file for an ONNX file (written atomically).")],
    recipe: Annotated[
        str | None, typer.Option("--recipe", help="Recipe TOML file, or a name under models/radreport_tiny/recipes/.")
    ] = None,
    passes: Annotated[
        list[str] | None, typer.Option("--pass", help="NAME[:key=value,...]; repeatable, applied in order.")
    ] = None,
    calib: Annotated[
        int | None,
        typer.Option(
            "--calib",
            min=1,
            help="Record N real decoder calibration feeds from the synthetic train split (else generated feeds).",
        ),
    ] = None,
    dim: Annotated[
        list[str] | None,
        typer.Option(
            "--dim",
            help="NAME=N: size of a symbolic input dimension in generated feeds (ONNX files; repeatable).",
        ),
    ] = None,
    force: ForceOption = False,
    no_check: Annotated[bool, typer.Option("--no-check", help="Skip the per-pass numerical check.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Apply passes to ONNX graphs, check each numerically against the model before it, and report."""
    from edgekit.passes import load_recipe, parse_pass_options, run_pipeline
    from edgekit.passes.base import DECODER
    from edgekit.passes.pipeline import resolve_source

    if bool(recipe) == bool(passes):
        raise ConfigError("give exactly one of --recipe FILE.toml or --pass NAME[:k=v,...]")
    pass_list = load_recipe(recipe).passes if recipe else parse_pass_options(list(passes or []))
    dims = _dims(dim or [])
    foreign = _foreign_onnx(source)
    if foreign and calib:
        raise ConfigError(
            "--calib records the default model's decoder feeds; it does not apply to an ONNX file", source
        )
    calibration = None
    if calib:
        from edgekit.passes.calibration import record_decoder_feeds

        if not as_json:
            err_console.print(f"recording {calib} decoder calibration feeds from the synthetic train split")
        calibration = {DECODER: record_decoder_feeds(resolve_source(source), calib)}

    with progress("passes", total=None, as_json=as_json) as bar:

        def on_pass(p, graph: str, phase: str) -> None:
            if phase == "start":
                bar.update(description=f"{p.name} on {graph}")
            else:
                bar.advance(1)

        if foreign:
            from edgekit.passes.onnx_file import optimize_onnx_file, optimize_onnx_folder

            run = optimize_onnx_file if source.is_file() else optimize_onnx_folder
            result = run(source, out, pass_list, dims=dims, check=not no_check, overwrite=force, on_pass=on_pass)
        else:
            result = run_pipeline(
                source, out, pass_list, calibration=calibration, check=not no_check, overwrite=force, on_pass=on_pass
            )

    if as_json:
        emit({"out": str(result.out), "seconds": result.seconds, **result.provenance()}, True)
        return
    rows = []
    for r in result.reports:
        worst = r.worst("logits") or r.worst()
        rows.append(
            {
                "pass": r.pass_name,
                "graph": r.graph.removesuffix(".onnx"),
                "size MB": f"{r.size_before / 1e6:.2f} -> {r.size_after / 1e6:.2f}",
                "ratio": f"{r.size_after / max(r.size_before, 1):.3f}",
                "nodes +/-": f"+{r.nodes_added}/-{r.nodes_removed}",
                "error (output: rel L2, max abs)": f"{worst.name}: {worst.rel_l2:.2e}, {worst.max_abs:.2e}"
                if worst
                else "not checked",
                "time s": f"{r.seconds:.2f}",
            }
        )
    emit(rows, False, title=f"edgekit optimize -> {result.out}")
    for r in result.reports:
        if r.notes.get("kept"):
            err_console.print(f"{r.pass_name}: kept at higher precision: {', '.join(r.notes['kept'])}")


def _dims(items: list[str]) -> dict[str, int]:
    dims = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--dim: expected NAME=N with N >= 1, got {item!r}")
        dims[name.strip()] = int(value)
    return dims


def _foreign_onnx(source: Path) -> bool:
    """An ONNX file, or a folder of ONNX files without edgekit's graph names (else the model-directory path)."""
    from edgekit.bundle.manifest import MANIFEST_NAME
    from edgekit.passes.base import ALL_GRAPHS

    if source.is_file():
        return source.suffix == ".onnx"
    if source.is_dir() and not (source / MANIFEST_NAME).is_file():
        return not any((source / g).is_file() for g in ALL_GRAPHS) and any(source.glob("*.onnx"))
    return False
