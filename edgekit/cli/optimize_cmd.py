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
        "edgekit optimize out/radreport-tiny-cpu -o out/int4-orin --pass int4:format=qdq-blocked",
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
    pass_list = _passes(recipe, passes)
    dims = _dims(dim or [])
    foreign = _foreign_onnx(source)
    calibration = _calibration(source, calib, foreign=foreign, quiet=as_json)
    result = _run(
        source,
        out,
        pass_list,
        foreign=foreign,
        dims=dims,
        calibration=calibration,
        check=not no_check,
        force=force,
        as_json=as_json,
    )
    _report(result, as_json)


def _passes(recipe: str | None, passes: list[str] | None) -> list:
    """The passes to run: a recipe's, or the `--pass` options in order; exactly one of the two."""
    from edgekit.passes import load_recipe, parse_pass_options

    if bool(recipe) == bool(passes):
        raise ConfigError("give exactly one of --recipe FILE.toml or --pass NAME[:k=v,...]")
    return load_recipe(recipe).passes if recipe else parse_pass_options(list(passes or []))


def _calibration(source: Path, calib: int | None, *, foreign: bool, quiet: bool) -> dict | None:
    """`--calib N`: N real decoder feeds recorded from the synthetic train split (the default model's only)."""
    if not calib:
        return None
    if foreign:
        raise ConfigError(
            "--calib records the default model's decoder feeds; it does not apply to an ONNX file", source
        )
    from edgekit.passes.base import DECODER
    from edgekit.passes.calibration import record_decoder_feeds
    from edgekit.passes.pipeline import resolve_source

    if not quiet:
        err_console.print(f"recording {calib} decoder calibration feeds from the synthetic train split")
    return {DECODER: record_decoder_feeds(resolve_source(source), calib)}


def _run(
    source: Path,
    out: Path,
    pass_list: list,
    *,
    foreign: bool,
    dims: dict[str, int],
    calibration: dict | None,
    check: bool,
    force: bool,
    as_json: bool,
):
    """The passes run on a model directory or bundle (`run_pipeline`), or on a foreign ONNX file or folder, a bar
    naming each pass and graph as it starts."""
    with progress("passes", total=None, as_json=as_json) as bar:

        def on_pass(p, graph: str, phase: str) -> None:
            if phase == "start":
                bar.update(description=f"{p.name} on {graph}")
            else:
                bar.advance(1)

        if foreign:
            from edgekit.passes.onnx_file import optimize_onnx_file, optimize_onnx_folder

            run = optimize_onnx_file if source.is_file() else optimize_onnx_folder
            return run(source, out, pass_list, dims=dims, check=check, overwrite=force, on_pass=on_pass)
        from edgekit.passes import run_pipeline

        return run_pipeline(
            source, out, pass_list, calibration=calibration, check=check, overwrite=force, on_pass=on_pass
        )


def _report(result, as_json: bool) -> None:
    """JSON (where it went, how long, the provenance), or a row per pass and the weights kept at higher precision."""
    if as_json:
        emit({"out": str(result.out), "seconds": result.seconds, **result.provenance()}, True)
        return
    emit([_row(r) for r in result.reports], False, title=f"edgekit optimize -> {result.out}")
    for r in result.reports:
        if r.notes.get("kept"):
            err_console.print(f"{r.pass_name}: kept at higher precision: {', '.join(r.notes['kept'])}")


def _row(r) -> dict:
    """One pass's report as a table row: sizes, nodes, the worst checked output (logits first), time."""
    worst = r.worst("logits") or r.worst()
    return {
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
