"""`edgekit optimize`: apply graph passes (quantization, FP16, sparsity, LoRA merge) to a model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.common import ForceOption, JsonOption, emit, err_console, examples, out_option, progress
from edgekit.errors import ConfigError

app = typer.Typer(help="Apply optimisation passes (quantisation, fusion) to ONNX graphs.")


@app.command(
    epilog=examples(
        "edgekit optimize out/radreport-tiny-cpu -o out/int4 --pass int4",
        "edgekit optimize out/radreport-tiny-cpu -o out/int4-awq --pass 'int4:block=32,method=awq,mixed=1' --calib 4",
        "edgekit optimize out/radreport-tiny-cpu -o out/int4-orin --pass int4:target=orin",
        "edgekit optimize out/radreport-tiny-cpu -o out/int8 --recipe int8 --json",
        "edgekit optimize out/radreport-tiny-cpu -o out/fp16 --recipe models/radreport_tiny/recipes/fp16.toml",
        note="SOURCE is a folder of ONNX graphs (from edgekit convert) or a bundle. A bundled recipe is named "
        "without its .toml: fp16, int8, int4, int4-awq, int4-orin, int4-heads38, int4-sparse24.",
    )
)
def optimize(
    source: Annotated[
        Path,
        typer.Argument(help="Model directory (the three ONNX graphs) or bundle (dir or .ekb).", show_default=False),
    ],
    out: Annotated[Path, out_option("Output model directory (written atomically).")],
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
