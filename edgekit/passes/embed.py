"""`qembed`: the token-embedding table of `embed_tokens.onnx` stored as blocked INT4 (or INT8), one scale per
block of `block` hidden units of each row.

Why: once the decoder's MatMuls are INT4, the FP32 (vocab, hidden) table is one of the largest things left in an
INT4 bundle. The table is a `Gather`, not a MatMul, so the int4 pass does not see it. The same symmetric block
quantizer as INT4 (`int4_encode.quantize_blocks`) gives the integers; two encodings write them:
- `gather` (the `cpu` default for 4 bits): ONNX Runtime `com.microsoft.GatherBlockQuantized(int4 table, ids,
  scales)` gathers and dequantizes only the rows asked for, so no float copy of the table is ever made.
- `dequantize` (orin, x1, and 8 bits): the standard-domain `DequantizeLinear(int table, scale, axis=1,
  block_size)` (opset 21) feeding the original `Gather`, which TensorRT 10 and any opset-21 runtime accept.
The graph keeps its interface: `input_ids` (int64) in, `inputs_embeds` (float32) out.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.names import EMBED_TOKENS

from .base import GraphPass, PassChanges, PassContext, PassPreconditionError
from .config import PassConfig, param
from .int4_encode import MS_DOMAIN, check_block, quantize_blocks
from .patterns import add_initializer


@dataclass
class EmbedQuantConfig(PassConfig):
    bits: int = param(4, choices=(4, 8), help="bits per table entry")
    block: int = param(32, choices=(16, 32, 64, 128), help="block size along the hidden axis")
    clip: int = param(0, min=0, max=50, help="range-shrink search steps per block (0: plain round to nearest)")
    target: str = param("cpu", choices=("cpu", "orin", "x1"), help="cpu uses GatherBlockQuantized for 4 bits")
    encoding: str = param(
        "auto",
        choices=("auto", "gather", "dequantize"),
        help="auto: gather on cpu at 4 bits, else dequantize (DequantizeLinear + Gather)",
    )

    def validate(self, where: str) -> None:
        if self.encoding == "gather" and self.bits != 4:
            raise ConfigError(
                f"{where}.encoding: gather (GatherBlockQuantized) is written for 4 bits only; "
                "use bits=4 or encoding=dequantize"
            )
        if self.encoding == "gather" and self.target != "cpu":
            raise ConfigError(
                f"{where}.encoding: gather is an ONNX Runtime contrib op, for target cpu only; "
                f"target {self.target} takes encoding=dequantize"
            )

    def resolved_encoding(self) -> str:
        if self.encoding != "auto":
            return self.encoding
        return "gather" if self.target == "cpu" and self.bits == 4 else "dequantize"


@dataclass
class EmbeddingGather:
    """The `Gather(table, ids, axis=0)` of a float (vocab, hidden) initializer."""

    node: ir.Node
    table: ir.Value


def find_embedding_gathers(model: ir.Model) -> list[EmbeddingGather]:
    out = []
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        axis = node.attributes.get("axis")
        table = node.inputs[0]
        if (axis is not None and axis.as_int() != 0) or table is None or not table.is_initializer():
            continue
        if (
            table.const_value is None
            or table.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16)
            or table.shape is None
            or len(table.shape) != 2
        ):
            continue
        out.append(EmbeddingGather(node, table))
    return out


class EmbedQuantPass(GraphPass):
    name = "qembed"
    Config = EmbedQuantConfig
    graphs = (EMBED_TOKENS,)

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        found = find_embedding_gathers(model)
        if not found:
            raise PassPreconditionError(
                f"{self.name}: no Gather of a float (vocab, hidden) table to quantize in {ctx.graph}", ctx.graph or None
            )
        for g in found:
            check_block(int(g.table.shape[1]), self.config.block, g.table.name)

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        cfg = self.config
        encoding = cfg.resolved_encoding()
        changes = PassChanges()
        for g in find_embedding_gathers(model):
            float_dtype = g.table.const_value.numpy().dtype  # the output keeps it (float32, or float16 after fp16)
            table = g.table.const_value.numpy().astype(np.float32)
            qw = quantize_blocks(table, cfg.block, bits=cfg.bits, symmetric=True, clip_grid=cfg.clip, name=g.table.name)
            signed = (qw.q.astype(np.int16) - 2 ** (cfg.bits - 1)).astype(ml_dtypes.int4 if cfg.bits == 4 else np.int8)
            base = g.table.name[: -len(".weight")] if g.table.name.endswith(".weight") else g.table.name
            codes = add_initializer(model.graph, signed, f"{base}.qweight")
            scales = add_initializer(model.graph, qw.scales.astype(float_dtype), f"{base}.scales")
            if encoding == "gather":
                changes.nodes_added += _encode_gather(model, g, codes, scales, cfg.block)
                changes.nodes_removed += 1
            else:
                changes.nodes_added += _encode_dequantize(model, g, codes, scales, cfg.block)
            changes.initializers_touched.append(g.table.name)
            if not g.table.uses() and not g.table.is_graph_output():
                model.graph.initializers.pop(g.table.name, None)
            err = np.abs(qw.dequantize() - table)
            changes.notes.setdefault("tables", {})[g.table.name] = {
                "shape": list(table.shape),
                "max_abs_error": float(err.max()),
                "rel_l2": float(np.linalg.norm(err) / (np.linalg.norm(table) + 1e-12)),
            }
        changes.notes.update(
            {
                "encoding": {"gather": "GatherBlockQuantized", "dequantize": "DequantizeLinear+Gather"}[encoding],
                "bits": cfg.bits,
                "block": cfg.block,
            }
        )
        return changes


def _encode_gather(model: ir.Model, g: EmbeddingGather, codes: ir.Value, scales: ir.Value, block: int) -> int:
    """Replace the Gather with GatherBlockQuantized(codes, ids, scales) on the same output value's name."""
    graph = model.graph
    node = ir.node(
        "GatherBlockQuantized",
        [codes, g.node.inputs[1], scales],
        {"gather_axis": 0, "quantize_axis": 1, "block_size": block},
        domain=MS_DOMAIN,
        name=f"{g.node.name}_Q",
    )
    graph.insert_before(g.node, node)
    old = g.node.outputs[0]
    new = node.outputs[0]
    new.name, new.dtype, new.shape = old.name, scales.dtype, old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.remove(g.node, safe=True)
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    graph.opset_imports.setdefault(MS_DOMAIN, 1)
    return 1


def _encode_dequantize(model: ir.Model, g: EmbeddingGather, codes: ir.Value, scales: ir.Value, block: int) -> int:
    """Feed the Gather from DequantizeLinear(codes (V, H), scales (V, H/B), axis=1, block_size=B)."""
    dq = ir.node(
        "DequantizeLinear", [codes, scales], {"axis": 1, "block_size": block}, name=f"{g.node.name}_DequantizeLinear"
    )
    dq.outputs[0].name = f"{g.table.name}_dq"
    dq.outputs[0].dtype = scales.dtype
    dq.outputs[0].shape = ir.Shape(list(codes.shape))
    model.graph.insert_before(g.node, dq)
    g.node.replace_input_with(0, dq.outputs[0])
    return 1
