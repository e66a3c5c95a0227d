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
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.ir_values import input_of
from edgekit.target import BuildInputs, TargetBuild

from . import reference
from .capability import CapabilityReport, check_model, refuse_unsupported
from .optable import OpTable, load_table
from .plan import make_plan
from .profiles import Limits, graph_paths, is_static, make_profiles
from .trt_graphs import GraphChanges, prepare_graphs

GRAPH_DIR = "orin-graphs"
FP32_DIR = "orin-fp32"
REFERENCE_ROLE, REFERENCE_FILE = "orin_reference", "orin_reference.npz"
CAPABILITY_ROLE, CAPABILITY_FILE = "orin_capability", "orin_capability.json"


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


_QUANT_KINDS: dict[ir.DataType | None, str] = {ir.DataType.INT4: "int4", ir.DataType.INT8: "int8"}
_FLOAT_KINDS: dict[ir.DataType | None, str] = {ir.DataType.FLOAT16: "fp16", ir.DataType.FLOAT: "fp32"}


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
                kind = _QUANT_KINDS.get(input_of(p, 0).dtype, "other")
                kind += "-blocked" if "block_size" in p.attributes else "-per-channel"
            elif w is not None and w.is_initializer():
                kind = _FLOAT_KINDS.get(w.dtype, str(w.dtype))
            else:
                continue
            key = f"{node.op_type}:{kind}"
            counts[key] = counts.get(key, 0) + 1
        out[role] = counts
    return out


@dataclass
class _Prepared:
    """The orin graphs in `graphs`, the capability reports of the recipe's graphs before the fixes and of the
    orin graphs after them, the changes the fixes made, and how long that took."""

    graphs: Path
    before: list[CapabilityReport]
    changes: list[GraphChanges]
    after: list[CapabilityReport]
    seconds: float


@dataclass
class _References:
    """The reference inputs by case, the file holding them with the orin graphs' outputs, and their parity."""

    inputs: dict[str, dict]
    path: Path
    parity: dict[str, dict]


def prepare(inputs: BuildInputs) -> TargetBuild:
    """The orin side of `edgekit build`: the steps of the module docstring, in order."""
    table = load_table()
    inputs.say(f"orin: capability check against TensorRT {table.tensorrt} ({table.cite()})")
    prepared = _prepare_graphs(inputs)
    model_config = _json(inputs.model_dir / names.WEIGHT_FILES["model_config"])
    generation = _json(inputs.model_dir / names.WEIGHT_FILES["generation_config"])
    preprocess = _json(inputs.model_dir / names.WEIGHT_FILES["preprocessor_config"])
    limits = Limits.of(model_config, generation, preprocess)
    profiles = make_profiles(graph_paths(prepared.graphs), limits)
    dla = _dla_fit(prepared.graphs, profiles)
    inputs.say("orin: reference inputs and parity in ONNX Runtime (cpu)")
    refs = _references(inputs, prepared.graphs, limits, model_config, preprocess)
    cap_path = _write_capability(inputs.work, table, prepared, dla)
    precision = {
        "compute": "FP16 for weight GEMMs, the patch Conv and embedding tables; FP32 for norms, softmax, RoPE, "
        "attention scores, the residual stream, graph inputs/outputs and the KV cache",
        "weights": weight_precision(prepared.graphs),
    }
    sparse = "sparse24" in inputs.recipe_passes
    runtime = make_plan(profiles=profiles, limits=limits, precision=precision, sparse=sparse)
    steps = [
        {
            "name": "orin_prepare",
            "params": {"tensorrt_table": table.tensorrt, "strongly_typed": True, "compute": "fp16"},
            "changes": [c.to_dict() for c in prepared.changes],
            "seconds": round(prepared.seconds, 3),
        }
    ]
    return TargetBuild(
        graphs=prepared.graphs,
        components={REFERENCE_ROLE: refs.path, CAPABILITY_ROLE: cap_path},
        figures=_figures(table, prepared, refs),
        steps=steps,
        runtime=runtime,
    )


def _prepare_graphs(inputs: BuildInputs) -> _Prepared:
    """The recipe's graphs fixed and made strongly typed for TensorRT, checked before and after: a node no fix
    covers stops the build here, named in the recipe's graph, before anything is spent on references."""
    t0 = time.perf_counter()
    graphs = inputs.work / GRAPH_DIR
    before, changes, after = prepare_graphs(inputs.graphs, graphs)
    refuse_unsupported(before, inputs.graphs)  # what no fix covers, named in the recipe's graph
    refuse_unsupported(after, graphs)
    leftover = [f.line() for r in after for f in r.findings]
    if leftover:  # a fix that did not take: a bug, but never ship it
        raise ConfigError(f"after the orin fixes: {leftover[0]}", graphs)
    return _Prepared(graphs, before, changes, after, time.perf_counter() - t0)


def _dla_fit(graphs: Path, profiles: dict[str, list[dict]]) -> dict[str, dict]:
    """What the DLA could take of each graph, were its profile static: the capability file records it for whoever
    weighs offloading to the DLA, which the build plan does not do."""
    dla = {}
    for role in names.graph_roles_in(graphs):
        rep = check_model(ir.load(graphs / names.GRAPH_FILES[role]), names.GRAPH_FILES[role], dla=True)
        dla_nodes = rep.nodes - len({f.node for f in rep.findings})
        dla[role] = {"nodes": rep.nodes, "dla_layers": dla_nodes, "static_profile": is_static(profiles[role])}
    return dla


def _references(inputs: BuildInputs, graphs: Path, limits: Limits, model_config: dict, preprocess: dict) -> _References:
    """Reference inputs and the orin graphs' outputs, saved for `edgekit engine check` on the device, and their
    parity to the FP32 export (and the recipe's graphs) here: the engines are held to what these graphs give."""
    if inputs.recipe is None:
        fp32 = inputs.graphs
    else:
        from edgekit.export import export_default

        fp32 = inputs.work / FP32_DIR
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
    ref_path = reference.save(inputs.work / REFERENCE_FILE, ref_inputs, ref_outputs)
    return _References(ref_inputs, ref_path, parity)


def _write_capability(work: Path, table: OpTable, prepared: _Prepared, dla: dict[str, dict]) -> Path:
    """The whole capability check (every finding before and after the fixes, the changes, the DLA fit) as a bundle
    file: the manifest's figure only counts them."""
    capability = {
        "table": table.cite(),
        "table_source": table.source["url"],
        "before_fixes": [r.to_dict() for r in prepared.before],
        "changes": [c.to_dict() for c in prepared.changes],
        "after_fixes": [r.to_dict() for r in prepared.after],
        "dla": dla,
    }
    cap_path = work / CAPABILITY_FILE
    cap_path.write_text(json.dumps(capability, indent=1) + "\n")
    return cap_path


def _figures(table: OpTable, prepared: _Prepared, refs: _References) -> dict[str, dict]:
    """The manifest's orin figures, each with its source: what the capability check found and fixed, and the
    parity of the orin graphs; they say that no TensorRT was run to get them."""
    fixed = [f for r in prepared.before for f in r.findings]  # each has its fix: refuse_unsupported passed them
    return {
        "orin_capability": {
            "tensorrt": table.tensorrt,
            "nodes": sum(r.nodes for r in prepared.after),
            "supported_nodes": sum(r.supported_nodes for r in prepared.after),
            "fixed_before_export": len(fixed),
            "fixes": sorted({f.fix for f in fixed if f.fix is not None}),
            "notes": sorted({n for r in prepared.after for n in r.notes}),
            "source": f"edgekit's capability check of the bundle's graphs against {table.cite()}; "
            f"no TensorRT was run (details in {CAPABILITY_FILE})",
        },
        "orin_parity": {
            **refs.parity,
            "cases": list(refs.inputs),  # a text model's bundle has no vision case
            "source": "ONNX Runtime CPU: the orin graphs against the FP32 export (and the recipe's graphs) on the "
            f"bundle's reference inputs ({REFERENCE_FILE}: one study's pixels, a {reference.PROMPT_TOKENS}-token "
            "prompt, prefill and one decode step); TensorRT not run",
        },
    }
