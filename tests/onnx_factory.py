"""ONNX graphs as other exporters write them (onnx.helper, every node unnamed), for the passes that must take any
ONNX file: shared by the INT4 tests and bench/int4_vs_ort.py."""

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def unnamed_matmul_chain(
    weights: Sequence[np.ndarray], *, relu: bool = True, opset: int = 17, name: str = "mlp"
) -> onnx.ModelProto:
    """MatMuls by `weights` ((K, N) each, float32) in a row, a Relu between each two when `relu`; input `x`
    (batch, K of the first), nodes unnamed; IR 10 from opset 21 (its DequantizeLinear block_size), else IR 9."""
    nodes, inits, x = [], [], "x"
    for i, w in enumerate(weights):
        inits.append(numpy_helper.from_array(np.asarray(w, np.float32), f"fc{i}.weight"))
        nodes.append(helper.make_node("MatMul", [x, f"fc{i}.weight"], [f"h{i}"]))
        x = f"h{i}"
        if relu and i < len(weights) - 1:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", weights[0].shape[0]])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", weights[-1].shape[1]])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10 if opset >= 21 else 9)
