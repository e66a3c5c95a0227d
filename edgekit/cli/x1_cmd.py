"""`edgekit x1`: tools for the X1 NPU target. `estimate` budgets a model from its shape alone (no weights);
`compile` and `inspect` make and read X1 programs (the emulator runs them through `edgekit run` / `profile`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.options import ForceOption, JsonOption, MachineOption, examples, out_option
from edgekit.cli.output import console, emit

app = typer.Typer(
    help="The X1 edge NPU: analytic estimates, compiling and disassembling programs (run them with "
    "`edgekit run` / `edgekit profile` on an x1 bundle).",
    no_args_is_help=True,
    epilog=examples(
        "edgekit x1 estimate qwen2-7b --weights int4 --head-sparsity 0.38 --context 1024",
        "edgekit x1 inspect out/radreport-tiny-x1/decoder_model_merged.x1",
    ),
)


@app.callback()
def _x1() -> None:
    """The X1 edge NPU (docs/x1/)."""


@app.command(
    epilog=examples(
        "edgekit x1 estimate qwen2-7b --weights int4 --head-sparsity 0.38 --context 1024",
        "edgekit x1 estimate                                  # the embedded radreport-tiny",
        "edgekit x1 estimate models/radreport_tiny/weights/config.json --weights int8 --json",
        note="MODEL is only a shape: no weights are read.",
    )
)
def estimate(
    model: Annotated[
        str | None,
        typer.Argument(
            help="qwen2-7b, radreport-tiny, smollm2-135m, a config.json or a model directory holding one. "
            "Default: the embedded radreport-tiny.",
            show_default=False,
            metavar="[MODEL]",
        ),
    ] = None,
    weights: Annotated[str, typer.Option("--weights", "-w", help="Weight format: int4, int8 or fp16.")] = "int4",
    head_sparsity: Annotated[
        float, typer.Option("--head-sparsity", help="DSS target: fraction of attention heads skipped per token.")
    ] = 0.0,
    context: Annotated[int, typer.Option("--context", "-c", help="KV-cache length when the token is made.")] = 1024,
    machine: MachineOption = None,
    as_json: JsonOption = False,
) -> None:
    """Per-token decode latency and energy from the analytic cost model, by op type, with the bound type."""
    from edgekit.describe_model import describe
    from edgekit.targets.x1.costmodel import Workload, estimate_decode
    from edgekit.targets.x1.machine import load_machine

    shape = describe(model or "radreport-tiny")
    mach = load_machine(machine)
    result = estimate_decode(shape, mach, Workload(weights=weights, head_sparsity=head_sparsity, context=context))
    if as_json:
        emit(result.to_dict(), True)
        return
    rows = [
        {
            "op": r["op"],
            "unit": r["unit"],
            "n": r["count"],
            "us/token": round(r["time_us"], 1),
            "time %": round(r["time_pct"], 1),
            "uJ/token": round(r["energy_uj"], 1),
            "energy %": round(r["energy_pct"], 1),
            "bound": r["bound"],
        }
        for r in result.by_kind()
    ]
    emit(
        rows,
        False,
        title=f"{shape.name} on {mach.machine.name}: {weights}, head sparsity {head_sparsity:g}, context {context}",
    )
    t = result.totals()
    emit(
        {
            "ms/token": round(t["ms_per_token"], 3),
            "J/token": round(t["j_per_token"], 4),
            "tokens/s": round(t["tokens_per_s"], 1),
            "average power W": round(t["avg_power_w"], 2),
            "weights streamed MB/token": round(t["weight_bytes_per_token"] / 1e6, 1),
            "of which from DRAM MB": round(t["weights_from_dram_bytes"] / 1e6, 1),
            "KV window / spilled tokens": f"{t['kv_window_tokens']} / {t['kv_spilled_tokens']}",
            "memory-bound time %": round(t["memory_bound_pct"], 1),
        },
        False,
        title="per token",
    )
    console.print(f"machine {mach.machine.name} {mach.short_hash} · analytic model, no weights read", markup=False)


@app.command(
    epilog=examples(
        "edgekit optimize out/radreport-tiny-cpu -o out/int4 --pass int4:format=qdq-blocked "
        "&& edgekit x1 compile out/int4 -o out/x1",
        "edgekit x1 compile out/radreport-tiny-x1 -o out/x1 --strict --json   # refuse host partitions",
        note="An x1 bundle (edgekit build --target x1) already holds its programs.",
    )
)
def compile(  # noqa: A001 - the subcommand's name
    model_dir: Annotated[
        Path,
        typer.Argument(
            help="Folder with the ONNX graphs (after the INT4 pass, target x1), or an x1 bundle directory.",
            show_default=False,
        ),
    ],
    out: Annotated[Path, out_option("Folder for the .x1 programs.")] = Path("out/x1"),
    force: ForceOption = False,
    machine: MachineOption = None,
    strict: Annotated[bool, typer.Option("--strict", help="Refuse nodes that would run on the host.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Compile the graphs of MODEL_DIR into X1 programs (one .x1 file per graph)."""
    from edgekit.targets.x1.backend import PROGRAM_FILES
    from edgekit.targets.x1.compiler import compile_graph, graph_files
    from edgekit.targets.x1.machine import load_machine

    mach = load_machine(machine)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for graph, source in graph_files(model_dir).items():
        start = time.perf_counter()
        prog = compile_graph(source, mach, strict=strict, graph_name=graph)
        seconds = time.perf_counter() - start  # the program holds no time: rebuilds are byte-identical
        path = prog.save(out / PROGRAM_FILES[graph])
        rows.append(
            {
                "graph": graph,
                "program": str(path),
                "bytes": path.stat().st_size,
                "instructions": len(prog.instructions),
                "host_partitions": prog.meta["host_partitions"],
                "compile_s": round(seconds, 3),
                "act_peak_kib": round(prog.memory_plan["act_peak_bytes"] / 1024, 1),
            }
        )
    emit(rows, as_json, title=f"X1 programs for {mach.machine.name} ({mach.short_hash})")


@app.command(
    epilog=examples(
        "edgekit x1 inspect out/radreport-tiny-x1/decoder_model_merged.x1",
        "edgekit x1 inspect out/radreport-tiny-x1/vision_encoder.x1 --json | jq '.instructions | length'",
        note="--machine must name the machine the program was compiled for.",
    )
)
def inspect(
    program: Annotated[Path, typer.Argument(help="An .x1 program file.", show_default=False)],
    machine: MachineOption = None,
    as_json: JsonOption = False,
) -> None:
    """Disassemble a program: one line per instruction (mnemonic, operands, ONNX symbol)."""
    from edgekit.targets.x1.machine import load_machine
    from edgekit.targets.x1.program import disassemble, load_program

    prog = load_program(program, load_machine(machine))
    rows = disassemble(prog)
    if as_json:
        emit({"header": prog.header, "meta": prog.meta, "host": prog.host, "instructions": rows}, True)
        return
    emit(
        [
            {
                "#": r["index"],
                "mnemonic": r["mnemonic"],
                "queue": r["queue"],
                "operands": " ".join(r["operands"]),
                "symbol": r["symbol"],
            }
            for r in rows
        ],
        False,
        title=f"{program.name}: ISA {prog.header['isa_version']}, machine {prog.machine_hash[:16]}",
    )
