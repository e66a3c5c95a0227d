"""The embedding table's encodings: how the `qembed` pass writes a quantized (vocab, hidden) table into
`embed_tokens.onnx`. Two, each a weight format's `encode_embedding` (`weight_formats.py`):
- `encode_gather`: ONNX Runtime `com.microsoft.GatherBlockQuantized(int4 table, ids, scales)` gathers and
  dequantizes only the rows asked for, so no float copy of the table is ever made;
- `encode_dequantize`: the standard-domain `DequantizeLinear(int table, scale, axis=1, block_size)` (opset 21)
  feeding the original `Gather`, which TensorRT 10 and any opset-21 runtime accept.
Why apart from the pass: the format registry names these encoders, and a pass module must not be imported by it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from .patterns import dtype_of, shape_of

MS_DOMAIN = "com.microsoft"


@dataclass
class EmbeddingGather:
    """The `Gather(table, ids, axis=0)` of a float (vocab, hidden) initializer."""

    node: ir.Node
    table: ir.Value


# (model, the Gather, signed codes (V, H), scales (V, H/B), block) -> (nodes added, nodes removed)
EmbeddingEncoder = Callable[[ir.Model, EmbeddingGather, ir.Value, ir.Value, int], tuple[int, int]]


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


def encode_gather(
    model: ir.Model, g: EmbeddingGather, codes: ir.Value, scales: ir.Value, block: int
) -> tuple[int, int]:
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
    new.name, new.dtype, new.shape = old.name, dtype_of(scales), old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.remove(g.node, safe=True)
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    graph.opset_imports.setdefault(MS_DOMAIN, 1)
    return 1, 1


def encode_dequantize(
    model: ir.Model, g: EmbeddingGather, codes: ir.Value, scales: ir.Value, block: int
) -> tuple[int, int]:
    """Feed the Gather from DequantizeLinear(codes (V, H), scales (V, H/B), axis=1, block_size=B)."""
    dq = ir.node(
        "DequantizeLinear", [codes, scales], {"axis": 1, "block_size": block}, name=f"{g.node.name}_DequantizeLinear"
    )
    dq.outputs[0].name = f"{g.table.name}_dq"
    dq.outputs[0].dtype = dtype_of(scales)
    dq.outputs[0].shape = ir.Shape(list(shape_of(codes)))
    model.graph.insert_before(g.node, dq)
    g.node.replace_input_with(0, dq.outputs[0])
    return 1, 0
