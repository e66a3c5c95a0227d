"""FP16: weights stored and MatMuls computed in half precision, everything numerically delicate kept in FP32.

Why this shape rather than a blanket float->half conversion: the MatMuls carry the bytes and the FLOPs, while
RMSNorm/LayerNorm (mean of squares), softmax, RoPE and the residual stream lose accuracy or overflow in FP16. So
each weight MatMul gets a Cast to FP16 on its activation (shared by MatMuls reading the same value: q/k/v, gate/up),
an FP16 weight (the Transpose folded away) and a Cast back to FP32 on its output. Graph inputs and outputs stay
FP32, so the runtime and the KV cache are unchanged. Embedding tables (`Gather` on a weight) are stored in FP16
and cast back after the lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from edgekit.ir_values import const_array, name_of

from .base import ALL_GRAPHS, GraphPass, PassChanges, PassContext, PassPreconditionError
from .config import PassConfig, param
from .patterns import add_initializer, find_weight_matmuls, matches_any, remove_if_unused

F16, F32 = ir.DataType.FLOAT16, ir.DataType.FLOAT


def output_to_fp16(model: ir.Model, node: ir.Node) -> None:
    """`node` now computes FP16: its output gets a fresh FP16 value, and a Cast back to FP32 takes the old name, so
    every consumer and graph output keeps reading FP32 (the fp16 pass and the orin target's typing share it)."""
    old = node.outputs[0]
    cast = ir.node("Cast", [old], {"to": F32}, name=f"{node.name}_CastToFp32")
    model.graph.insert_after(node, cast)
    new = cast.outputs[0]
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    cast.replace_input_with(0, old)
    old.name, new.name = f"{name}_fp16", name
    old.dtype, new.dtype = F16, F32
    if old.shape is not None:
        new.shape = old.shape


@dataclass
class Fp16Config(PassConfig):
    exclude: list[str] = param([], help="module-name patterns kept in FP32")
    embeddings: bool = param(True, help="store Gather'ed embedding tables in FP16")


class Fp16Pass(GraphPass):
    name = "fp16"
    Config = Fp16Config
    config: Fp16Config  # what GraphPass.__init__ checks it is
    graphs = ALL_GRAPHS
    max_rel_error = 0.05

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        if not find_weight_matmuls(model) and not _embedding_gathers(model):
            raise PassPreconditionError(
                f"fp16: no weight MatMul or embedding table to convert in {ctx.graph}", ctx.graph
            )

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        changes = PassChanges()
        graph = model.graph
        casts: dict[ir.Value, ir.Value] = {}  # activation -> its FP16 cast
        for m in find_weight_matmuls(model):
            if matches_any(m.name, self.config.exclude) or m.weight.dtype != F32:
                continue
            act = m.activation
            if act not in casts:
                cast = ir.node("Cast", [act], {"to": F16}, name=f"{m.node.name}_CastToFp16")
                cast.outputs[0].name, cast.outputs[0].dtype = f"{act.name}_fp16", F16
                graph.insert_before(m.node, cast)
                casts[act] = cast.outputs[0]
                changes.nodes_added += 1
            w16 = add_initializer(graph, np.ascontiguousarray(m.kn().astype(np.float16)), f"{m.name}.weight_fp16")
            m.node.replace_input_with(0, casts[act])
            m.node.replace_input_with(1, w16)
            changes.nodes_added += self._cast_back(model, m.node, changes)
            changes.initializers_touched.append(m.weight_name)
            changes.nodes_removed += remove_if_unused(model, m.transpose)
            if m.weight.is_initializer() and not m.weight.uses():
                graph.initializers.pop(m.weight_name, None)
        if self.config.embeddings:
            for node, table in _embedding_gathers(model):
                table_name = name_of(table)  # an initializer's
                if matches_any(table_name, self.config.exclude):
                    continue
                table.const_value = ir.Tensor(const_array(table).astype(np.float16), name=table_name)
                table.dtype = F16
                changes.nodes_added += self._cast_back(model, node, changes)
                changes.initializers_touched.append(table_name)
        changes.notes = {
            "fp32_kept": "norms, softmax, RoPE, residual stream, graph inputs/outputs",
            "shared_input_casts": len(casts),
        }
        return changes

    @staticmethod
    def _cast_back(model: ir.Model, node: ir.Node, changes: PassChanges) -> int:
        output_to_fp16(model, node)
        return 1


def _embedding_gathers(model: ir.Model) -> list[tuple[ir.Node, ir.Value]]:
    out = []
    for node in model.graph:
        if node.op_type == "Gather" and node.inputs[0] is not None and node.inputs[0].is_initializer():
            table = node.inputs[0]
            if table.dtype == F32 and table.shape is not None and len(table.shape) == 2 and len(table.uses()) == 1:
                out.append((node, table))
    return out
