"""`edgekit x1`: tools for the X1 NPU target. `estimate` budgets a model from its shape alone (no weights);
`compile` and `inspect` make and read X1 programs (the emulator runs them through `edgekit run` / `profile`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.common import JsonOption, console, emit

app = typer.Typer(
    help="The X1 edge NPU: analytic estimates, compiling and disassembling programs (run them with "
         "`edgekit run` / `edgekit profile` on an x1 bundle).",
    no_args_is_help=True,
    epilog=(
        "Examples:\n\n"
        "  edgekit x1 estimate --model qwen2-7b --weights int4 --head-sparsity 0.38 --context 1024\n\n"
        "  edgekit x1 estimate --model radreport-tiny --json"
    ),
)


@app.callback()
def _x1() -> None:
    """The X1 edge NPU (docs/x1/)."""


@app.command()
def estimate(
    model: Annotated[str, typer.Option("--model", "-m", help="qwen2-7b, radreport-tiny, smollm2-135m, or a "
                                       "config.json path.")] = "radreport-tiny",
    weights: Annotated[str, typer.Option("--weights", "-w", help="Weight format: int4, int8 or fp16.")] = "int4",
    head_sparsity: Annotated[float, typer.Option("--head-sparsity", "-s",
                                                 help="DSS target: fraction of attention heads skipped per "
                                                      "token.")] = 0.0,
    context: Annotated[int, typer.Option("--context", "-c", help="KV-cache length when the token is made.")] = 1024,
    machine: Annotated[Path | None, typer.Option("--machine", help="Machine description TOML (default: the "
                                                 "bundled x1-default.toml).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Per-token decode latency and energy from the analytic cost model, by op type, with the bound type."""
    from edgekit.targets.x1.costmodel import Workload, estimate_decode
    from edgekit.targets.x1.machine import load_machine
    from edgekit.targets.x1.model_configs import resolve

    shape = resolve(model)
    mach = load_machine(machine)
    result = estimate_decode(shape, mach, Workload(weights=weights, head_sparsity=head_sparsity, context=context))
    if as_json:
        emit(result.to_dict(), True)
        return
    rows = [{"op": r["op"], "unit": r["unit"], "n": r["count"], "us/token": round(r["time_us"], 1),
             "time %": round(r["time_pct"], 1), "uJ/token": round(r["energy_uj"], 1),
             "energy %": round(r["energy_pct"], 1), "bound": r["bound"]} for r in result.by_kind()]
    emit(rows, False, title=f"{shape.name} on {mach.machine.name}: {weights}, head sparsity {head_sparsity:g}, "
                            f"context {context}")
    t = result.totals()
    emit({"ms/token": round(t["ms_per_token"], 3), "J/token": round(t["j_per_token"], 4),
          "tokens/s": round(t["tokens_per_s"], 1), "average power W": round(t["avg_power_w"], 2),
          "weights streamed MB/token": round(t["weight_bytes_per_token"] / 1e6, 1),
          "of which from DRAM MB": round(t["weights_from_dram_bytes"] / 1e6, 1),
          "KV window / spilled tokens": f"{t['kv_window_tokens']} / {t['kv_spilled_tokens']}",
          "memory-bound time %": round(t["memory_bound_pct"], 1)}, False, title="per token")
    console.print(f"machine {mach.machine.name} {mach.short_hash} · analytic model, no weights read", markup=False)


@app.command(epilog=(
    "Examples:\n\n"
    "  edgekit optimize out/onnx -o out/int4 --pass int4:target=x1 && edgekit x1 compile out/int4 -o out/x1\n\n"
    "  edgekit x1 compile out/int4 --strict --json   (refuse host partitions; machine-readable summary)"))
def compile(  # noqa: A001 - the subcommand's name
    model_dir: Annotated[Path, typer.Argument(help="Folder with the ONNX graphs (after the INT4 pass, target x1).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the .x1 programs.")] = Path("out/x1"),
    machine: Annotated[Path | None, typer.Option("--machine", help="Machine description TOML (default: the "
                                                 "bundled x1-default.toml).")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Refuse nodes that would run on the host.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Compile the graphs of MODEL_DIR into X1 programs (one .x1 file per graph)."""
    from edgekit.targets.x1.backend import PROGRAM_FILES
    from edgekit.targets.x1.compiler import compile_model
    from edgekit.targets.x1.machine import load_machine

    mach = load_machine(machine)
    programs = compile_model(model_dir, mach, strict=strict)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for graph, prog in programs.items():
        path = prog.save(out / PROGRAM_FILES[graph])
        rows.append({"graph": graph, "program": str(path), "bytes": path.stat().st_size,
                     "instructions": len(prog.instructions), "host_partitions": prog.meta["host_partitions"],
                     "compile_s": round(prog.meta["compile_seconds"], 3),
                     "act_peak_kib": round(prog.memory_plan["act_peak_bytes"] / 1024, 1)})
    emit(rows, as_json, title=f"X1 programs for {mach.machine.name} ({mach.short_hash})")


@app.command(epilog=(
    "Examples:\n\n"
    "  edgekit x1 inspect out/radreport-tiny-x1/decoder_model_merged.x1\n\n"
    "  edgekit x1 inspect out/x1/vision_encoder.x1 --json | jq '.instructions | length'"))
def inspect(
    program: Annotated[Path, typer.Argument(help="An .x1 program file.")],
    machine: Annotated[Path | None, typer.Option("--machine", help="Machine description TOML the program was "
                                                 "compiled for (default: x1-default.toml).")] = None,
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
    emit([{"#": r["index"], "mnemonic": r["mnemonic"], "queue": r["queue"], "operands": " ".join(r["operands"]),
           "symbol": r["symbol"]} for r in rows], False,
         title=f"{program.name}: ISA {prog.header['isa_version']}, machine {prog.machine_hash[:16]}")
