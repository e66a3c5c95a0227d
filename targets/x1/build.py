"""The x1 build side: graphs -> compiled X1 programs.

Without a recipe the exported FP32 graphs are quantized here first: INT4 for the X1 (blocked, symmetric
DequantizeLinear, `DEFAULT_BLOCK`, in the first of `X1Target.weight_formats`), so plain `edgekit build --target x1`
ships the X1's native precision. With a recipe, the recipe decides the precision and its passes have already
written it in a format the X1 takes (the generic build fills `X1Target.weight_formats` in): its graphs are
compiled as they are, fp16 to `XL_GEMM.F16`, int8 to `XL_GEMM.W8A8`, int4 to `XL_GEMM.W4A8` (quantizing them again
is what used to fail).

The bundle keeps the ONNX graphs the programs were compiled from (so `bench/x1_parity.py` can run them in ONNX
Runtime side by side), the programs, the machine description they were compiled for, and a `runtime` section
the run side reads: DSS settings (`backend.RUNTIME_DEFAULTS`).
"""

from __future__ import annotations

import time
from pathlib import Path

from edgekit.passes import find_weight_matmuls
from edgekit.target import BuildInputs, TargetBuild

from .backend import MACHINE_ROLE, PROGRAM_FILES, PROGRAM_ROLES, RUNTIME_DEFAULTS

INT4_DIR = "x1-int4"
PROGRAM_DIR = "x1-programs"
DEFAULT_BLOCK = 32


def int4_block(graphs: Path) -> int:
    """32 (the X1 default) when it divides the K of every weight MatMul, else the largest block that does."""
    import onnx_ir as ir

    ks = set()
    for f in sorted(graphs.glob("*.onnx")):
        for m in find_weight_matmuls(ir.load(f)):
            ks.add(m.k)  # K of the weight as MatMul consumes it (a transposed one is stored (N, K))
    return next((b for b in (DEFAULT_BLOCK, 16) if all(k % b == 0 for k in ks)), 16)


def prepare(inputs: BuildInputs) -> TargetBuild:
    from edgekit.passes.pipeline import run_pipeline
    from edgekit.passes.registry import make_pass

    from . import TARGET
    from .compiler import compile_model
    from .machine import DEFAULT_MACHINE, load_machine

    say, work = inputs.say, inputs.work
    if inputs.recipe is None:
        block = int4_block(inputs.graphs)
        weight_format = TARGET.weight_formats[0]
        spec = f"int4:block={block},format={weight_format}"
        say(f"passes: {spec}")
        graphs = work / INT4_DIR
        result = run_pipeline(inputs.graphs, graphs, [make_pass(spec)], overwrite=True)
        steps = [result.step("int4", {"block": block, "format": weight_format})]
        compiled_from = "the INT4 graphs"
    else:
        graphs, steps, compiled_from = inputs.graphs, [], f"the graphs of recipe {inputs.recipe}"
    mach = load_machine(inputs.machine)
    say(f"compile: X1 programs for machine {mach.machine.name} ({mach.short_hash})")
    t0 = time.perf_counter()
    programs = compile_model(graphs, mach)
    seconds = time.perf_counter() - t0
    out = work / PROGRAM_DIR
    out.mkdir()
    components, sizes = {}, {}
    for graph, prog in programs.items():
        path = prog.save(out / PROGRAM_FILES[graph])
        components[PROGRAM_ROLES[graph]] = path
        sizes[graph] = path.stat().st_size
    components[MACHINE_ROLE] = Path(inputs.machine) if inputs.machine else DEFAULT_MACHINE
    steps.append({"name": "x1_compile", "params": {"machine": mach.machine.name, "machine_hash": mach.hash}})
    figures = {
        "x1_compile": {
            "machine": mach.machine.name,
            "machine_hash": mach.hash,
            "compile_seconds": round(seconds, 3),
            "program_bytes": sizes,
            "host_partitions": {g: p.meta["host_partitions"] for g, p in programs.items()},
            "instructions": {g: len(p.instructions) for g, p in programs.items()},
            "source": f"measured during this build: wall time of compile_model on {compiled_from}; program file sizes",
        }
    }
    return TargetBuild(
        graphs=graphs, components=components, figures=figures, steps=steps, runtime=dict(RUNTIME_DEFAULTS)
    )
