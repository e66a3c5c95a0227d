"""ONNX (after the passes) -> X1 programs: pattern-match the big blocks, lower the rest generically.

Why pattern matching on the exported graphs: the exporter decomposes RMSNorm, RoPE, SiLU, GELU and attention into
small ONNX ops so every consumer reads one op vocabulary; the X1 has fused instructions for exactly those blocks
(isa.md), and running them fused is where its speed and its integer numerics come from. What matches becomes
`XL_GEMM.*`, `VRMSNORM`, `XL_ROPE_ROTATE`, `KVAPPEND + XL_VMATMUL_CAUSAL + VSOFTMAX + XL_VMATMUL_PV`,
`VSILU_MUL`, `VGELU`, `VLAYERNORM`; other ops this compiler knows lower one-to-one to vector/layout instructions;
anything else becomes a host partition (a one-node ONNX model run by ONNX Runtime), or an error under `strict`.

This module assembles a Program from the lowered groups (tensor ids, memory plan, I/O, statistics); the graph is
read as onnx-ir (`graph_view`), lowered by `lowering` with the patterns of `lower_attention`, `lower_matmul` and
`lower_vector`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import onnx
import onnx_ir as ir

from edgekit.ir_values import name_of
from edgekit.names import GRAPH_FILES

from .graph_view import GraphView, load_graph
from .lowering import GENERIC, CompileError, Lowering
from .machine import Machine
from .memplan import nominal_bytes, plan_memory
from .program import ISA_VERSION, Instr, Program, address

__all__ = ["GENERIC", "CompileError", "compile_graph", "compile_model"]

LAYER_RE = re.compile(r"layers\.(\d+)/")


def _io_entry(g: GraphView, v: ir.Value) -> dict:
    """A graph input or output as IODS records it: the declared dtype, the shape as shape inference gave it."""
    name = name_of(v)
    return {"name": name, "shape": g.shape(name), "dtype": int(v.dtype) if v.dtype is not None else 0}


def compile_graph(
    path: str | Path, machine: Machine, *, strict: bool = False, graph_name: str | None = None, plan_seq: int = 64
) -> Program:
    """One ONNX file -> one Program."""
    path = Path(path)
    g, low, groups = _lower(path, machine, strict, graph_name or path.name)
    table = _TensorTable(g, plan_seq)
    for v in g.inputs:
        table.tid(name_of(v), 0)
    instrs, attrs, symbols = _emit(groups, table)
    end = len(instrs)
    for v in g.outputs:
        if v.name in table.ids:
            table.tid(v.name, end)
    instrs.append(Instr("END"))
    plan = plan_memory(
        table.tensors, table.uses, int((machine.sram.banks - machine.sram.kv_banks) * machine.bank_bytes)
    )
    io = {
        "inputs": [_io_entry(g, v) for v in g.inputs],
        "outputs": [_io_entry(g, v) for v in g.outputs],
        "kv_outputs": {str(k): list(v) for k, v in low.kv_outputs.items()},
    }
    meta = _meta(g, low, instrs, graph_name or path.stem, path.name)
    header = {"magic": "EKX1PRG", "isa_version": ISA_VERSION, "machine_hash": machine.hash}
    return Program(
        header, instrs, symbols, io, attrs, low.weights, low.weight_space, plan, low.host, low.host_models, meta
    )


def _lower(path: Path, machine: Machine, strict: bool, name: str) -> tuple[GraphView, Lowering, list]:
    """Read the graph and lower it to groups of (mnemonic, attributes); errors name the file."""
    try:
        g = load_graph(path)
    except Exception as err:  # protobuf decode errors have many types
        raise CompileError(f"cannot read ONNX graph ({type(err).__name__})", path) from err
    low = Lowering(g, machine, strict, name)
    try:
        groups = low.lower()
    except CompileError as err:
        raise CompileError(err.reason, path) from None
    return g, low, groups


class _TensorTable:
    """Tensor ids in order of first use, each tensor's record for the memory plan, and its live range
    (first and last instruction index)."""

    def __init__(self, g: GraphView, plan_seq: int):
        self.g, self.plan_seq = g, plan_seq
        self.ids: dict[str, int] = {}
        self.tensors: list[dict] = []
        self.uses: dict[int, tuple[int, int]] = {}

    def tid(self, name: str, index: int) -> int:
        """`name`'s id, registered on first sight; instruction `index` extends its live range."""
        if name not in self.ids:
            self.ids[name] = len(self.tensors)
            self.tensors.append(self._record(name))
        i = self.ids[name]
        f, _ = self.uses.get(i, (index, index))
        self.uses[i] = (f, index)
        return i

    def _record(self, name: str) -> dict:
        g = self.g
        dt = g.dtype(name)
        nbytes = 8 if dt == onnx.TensorProto.INT64 else (1 if dt == onnx.TensorProto.BOOL else 4)
        const = g.is_const_name(name)
        return {
            "name": name,
            "shape": g.shape(name),
            "resident": const,
            "space": "NMW" if const else "ACT",
            "bytes": nominal_bytes(g.shape(name), nbytes, self.plan_seq),
        }


def _emit(groups: list, table: _TensorTable) -> tuple[list[Instr], list[dict], dict[int, str]]:
    """The lowered groups as instructions: each gets its attributes (layer, operand ids) and its symbol."""
    instrs: list[Instr] = []
    attrs: list[dict] = []
    symbols: dict[int, str] = {}
    for symbol, group in groups:
        for mnem, attr in group:
            idx = len(instrs)
            ins_ids = [table.tid(v, idx) for v in attr.get("in", []) if v]
            out_ids = [table.tid(v, idx) for v in attr.get("out", []) if v]
            layer = attr.get("layer")
            if layer is None:
                m = LAYER_RE.search(symbol)
                layer = int(m.group(1)) if m else None
            attr = {**attr, "layer": layer, "in_ids": ins_ids, "out_ids": out_ids}
            attrs.append(attr)
            refs = [address("ACT", t) for t in (ins_ids + out_ids)[:6]]
            instrs.append(Instr(mnem, (len(attrs) - 1, *refs)))
            symbols[idx] = symbol
    return instrs, attrs, symbols


def _meta(g: GraphView, low: Lowering, instrs: list[Instr], graph: str, source: str) -> dict:
    """The program's statistics: instruction counts, fused blocks, host partitions. No compile time: a program is
    a function of its graph and machine, byte for byte, so a rebuild (and the manifest that signs it) reproduces;
    the build records its wall time in the bundle's figures instead."""
    counts: defaultdict[str, int] = defaultdict(int)
    for ins in instrs:
        counts[ins.mnemonic] += 1
    return {
        "graph": graph,
        "source": source,
        "instructions": dict(counts),
        "fused": dict(low.fused),
        "host_partitions": len(low.host),
        "onnx_nodes": len(g.nodes),
    }


def graph_files(model_dir: str | Path) -> dict[str, Path]:
    """The graphs present in `model_dir` by role (the roles and file names of `edgekit.names.GRAPH_FILES`);
    refused if there is none."""
    model_dir = Path(model_dir)
    found = {role: model_dir / f for role, f in GRAPH_FILES.items() if (model_dir / f).is_file()}
    if not found:
        raise CompileError(f"no ONNX graphs ({', '.join(GRAPH_FILES.values())}) to compile", model_dir)
    return found


def compile_model(model_dir: str | Path, machine: Machine, *, strict: bool = False) -> dict[str, Program]:
    """The graphs present in `model_dir` -> {"vision_encoder" | "embed_tokens" | "decoder": Program}."""
    return {
        role: compile_graph(path, machine, strict=strict, graph_name=role)
        for role, path in graph_files(model_dir).items()
    }
