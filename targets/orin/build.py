"""The orin build side: the recipe's graphs in, TensorRT-ready graphs, a build plan and parity references out.

Runs on any machine; nothing here needs TensorRT. Steps, each leaving a figure with its source:
1. capability check of the recipe's graphs against TensorRT 10.3 (`capability`), the fixes it names applied and
   the graphs made strongly typed FP16 (`trt_graphs`); the result is checked again and must be clean, else the
   build stops with one line naming the node;
2. optimisation profiles from the model's limits (`profiles`) and the build plan (`plan`) into the manifest's
   `runtime` section;
3. reference inputs and the orin graphs' outputs for `edgekit engine check` (`reference`), and their parity to the
   FP32 export (and to the recipe's graphs) in ONNX Runtime on cpu.
The engines themselves are built on the Jetson (`edgekit engine build`): an engine is only valid for the
TensorRT, JetPack and GPU that built it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.target import BuildInputs, TargetBuild

from . import reference
from .capability import check_model, refuse_unsupported
from .optable import load_table
from .plan import make_plan
from .profiles import Limits, graph_paths, is_static, make_profiles
from .trt_graphs import prepare_graphs

GRAPH_DIR = "orin-graphs"
FP32_DIR = "orin-fp32"
REFERENCE_ROLE, REFERENCE_FILE = "orin_reference", "orin_reference.npz"
CAPABILITY_ROLE, CAPABILITY_FILE = "orin_capability", "orin_capability.json"


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def weight_precision(graphs: Path) -> dict:
    """How the GEMM weights of the prepared graphs are stored: counts by kind, per graph."""
    out = {}
    for role in names.graph_roles_in(graphs):
        counts: dict[str, int] = {}
        for node in ir.load(graphs / names.GRAPH_FILES[role]).graph:
            if node.op_type not in ("MatMul", "Conv", "Gather") or len(node.inputs) < 2:
                continue
            w = node.inputs[0] if node.op_type == "Gather" else node.inputs[1]
            p = w.producer() if w is not None else None
            if p is not None and p.op_type == "DequantizeLinear":
                kind = {ir.DataType.INT4: "int4", ir.DataType.INT8: "int8"}.get(p.inputs[0].dtype, "other")
                kind += "-blocked" if "block_size" in p.attributes else "-per-channel"
            elif w is not None and w.is_initializer():
                kind = {ir.DataType.FLOAT16: "fp16", ir.DataType.FLOAT: "fp32"}.get(w.dtype, str(w.dtype))
            else:
                continue
            key = f"{node.op_type}:{kind}"
            counts[key] = counts.get(key, 0) + 1
        out[role] = counts
    return out


def prepare(inputs: BuildInputs) -> TargetBuild:
    say, work = inputs.say, inputs.work
    table = load_table()
    say(f"orin: capability check against TensorRT {table.tensorrt} ({table.cite()})")
    t0 = time.perf_counter()
    graphs = work / GRAPH_DIR
    before, changes, after = prepare_graphs(inputs.graphs, graphs)
    refuse_unsupported(before, inputs.graphs)  # what no fix covers, named in the recipe's graph
    refuse_unsupported(after, graphs)
    leftover = [f.line() for r in after for f in r.findings]
    if leftover:  # a fix that did not take: a bug, but never ship it
        raise ConfigError(f"after the orin fixes: {leftover[0]}", graphs)
    prep_seconds = time.perf_counter() - t0

    model_config = _json(inputs.model_dir / names.WEIGHT_FILES["model_config"])
    generation = _json(inputs.model_dir / names.WEIGHT_FILES["generation_config"])
    preprocess = _json(inputs.model_dir / names.WEIGHT_FILES["preprocessor_config"])
    limits = Limits.of(model_config, generation, preprocess)
    profiles = make_profiles(graph_paths(graphs), limits)

    dla = {}  # what the DLA could take of each graph, were its profile static
    for role in names.graph_roles_in(graphs):
        rep = check_model(ir.load(graphs / names.GRAPH_FILES[role]), names.GRAPH_FILES[role], dla=True)
        dla_nodes = rep.nodes - len({f.node for f in rep.findings})
        dla[role] = {"nodes": rep.nodes, "dla_layers": dla_nodes, "static_profile": is_static(profiles[role])}

    say("orin: reference inputs and parity in ONNX Runtime (cpu)")
    if inputs.recipe is None:
        fp32 = inputs.graphs
    else:
        from edgekit.export import export_default

        fp32 = work / FP32_DIR
        export_default(inputs.model_dir, fp32)
    ref_inputs = reference.make_inputs(
        fp32,
        frames=limits.frames,
        image_size=int(preprocess.get("image_size", model_config.get("image_size", 64))),
        vocab=int(model_config.get("vocab_size", 2)),
    )
    ref_outputs = reference.run_cases(graphs, ref_inputs)
    parity = {"vs_fp32_export": reference.compare(ref_outputs, reference.run_cases(fp32, ref_inputs))}
    if inputs.recipe is not None:
        recipe_outputs = reference.run_cases(inputs.graphs, ref_inputs)
        parity[f"vs_recipe_{inputs.recipe}"] = reference.compare(ref_outputs, recipe_outputs)
    ref_path = reference.save(work / REFERENCE_FILE, ref_inputs, ref_outputs)

    capability = {
        "table": table.cite(),
        "table_source": table.source["url"],
        "before_fixes": [r.to_dict() for r in before],
        "changes": [c.to_dict() for c in changes],
        "after_fixes": [r.to_dict() for r in after],
        "dla": dla,
    }
    cap_path = work / CAPABILITY_FILE
    cap_path.write_text(json.dumps(capability, indent=1) + "\n")

    precision = {
        "compute": "FP16 for weight GEMMs, the patch Conv and embedding tables; FP32 for norms, softmax, RoPE, "
        "attention scores, the residual stream, graph inputs/outputs and the KV cache",
        "weights": weight_precision(graphs),
    }
    sparse = "sparse24" in inputs.recipe_passes
    runtime = make_plan(profiles=profiles, limits=limits, precision=precision, sparse=sparse)
    fixed = [{"graph": f.graph, "node": f.node, "fix": f.fix} for r in before for f in r.findings]
    nodes = sum(r.nodes for r in after)
    figures = {
        "orin_capability": {
            "tensorrt": table.tensorrt,
            "nodes": nodes,
            "supported_nodes": sum(r.supported_nodes for r in after),
            "fixed_before_export": len(fixed),
            "fixes": sorted({f["fix"] for f in fixed}),
            "notes": sorted({n for r in after for n in r.notes}),
            "source": f"edgekit's capability check of the bundle's graphs against {table.cite()}; "
            f"no TensorRT was run (details in {CAPABILITY_FILE})",
        },
        "orin_parity": {
            **parity,
            "cases": list(ref_inputs),  # a text model's bundle has no vision case
            "source": "ONNX Runtime CPU: the orin graphs against the FP32 export (and the recipe's graphs) on the "
            f"bundle's reference inputs ({REFERENCE_FILE}: one study's pixels, a {reference.PROMPT_TOKENS}-token "
            "prompt, prefill and one decode step); TensorRT not run",
        },
    }
    steps = [
        {
            "name": "orin_prepare",
            "params": {"tensorrt_table": table.tensorrt, "strongly_typed": True, "compute": "fp16"},
            "changes": [c.to_dict() for c in changes],
            "seconds": round(prep_seconds, 3),
        }
    ]
    return TargetBuild(
        graphs=graphs,
        components={REFERENCE_ROLE: ref_path, CAPABILITY_ROLE: cap_path},
        figures=figures,
        steps=steps,
        runtime=runtime,
    )
