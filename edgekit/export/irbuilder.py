"""A thin layer over `onnx_ir`'s Tape that keeps exported graphs readable and traceable.

Why not the bare Tape: every node gets a name after the module it implements (`/model/layers.0/self_attn/q_proj/
MatMul`) so reports and profiles can point at it; weights become initializers under their safetensors names (so
LoRA merge and INT4 passes find them by Hugging Face module names); small constants (shapes, axes, epsilons) are
`Constant` nodes, deduplicated, so the initializer list holds weights and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.tape import Tape

from edgekit.errors import EdgekitError

OPSET = 21
IR_VERSION = 10  # the IR version that goes with opset 21


def scope_of(prefix: str) -> str:
    """`model.layers.0.self_attn.q_proj` -> `/model/layers.0/self_attn/q_proj` (list indices stay with their list)."""
    parts: list[str] = []
    for part in prefix.split("."):
        if part.isdigit() and parts:
            parts[-1] = f"{parts[-1]}.{part}"
        else:
            parts.append(part)
    return "/" + "/".join(parts)


class GraphBuilder:
    """Collects nodes, weight initializers, inputs and outputs of one graph; `model()` returns the `ir.Model`."""

    def __init__(self, weights: Mapping[str, np.ndarray], name: str):
        self.name = name
        self.tape = Tape()
        self._weights = weights
        self._initializers: dict[str, ir.Value] = {}
        self._constants: dict[tuple, ir.Value] = {}
        self._node_names: set[str] = set()
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []

    # graph interface -------------------------------------------------------------------------------------------
    def input(self, name: str, dtype: ir.DataType, shape: Sequence[int | str]) -> ir.Value:
        value = ir.val(name, dtype, shape)
        self.inputs.append(value)
        return value

    def output(self, value: ir.Value, name: str, dtype: ir.DataType, shape: Sequence[int | str]) -> None:
        value.name = name
        value.dtype = dtype
        value.shape = ir.Shape(shape)
        self.outputs.append(value)

    def weight(self, name: str) -> ir.Value:
        """The initializer for weight `name` (float32), created on first use."""
        if name not in self._initializers:
            if name not in self._weights:
                raise EdgekitError(f"weight {name!r} is missing from the checkpoint", code="invalid_weights")
            array = np.ascontiguousarray(self._weights[name], dtype=np.float32)
            self._initializers[name] = self.tape.initializer(ir.Tensor(array, name=name), name=name)
        return self._initializers[name]

    def const(self, value, dtype=np.int64) -> ir.Value:
        """A `Constant` node for a small literal (shape, axes, scalar); equal literals share one node."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self._unique(f"/Constant_{len(self._constants)}")
            out = self.tape.op("Constant", [], {"value": ir.Tensor(array)}, name=name)
            out.name = f"{name}_output_0"
            self._constants[key] = out
        return self._constants[key]

    def op(self, scope: str, op_type: str, inputs: Sequence[ir.Value | None], attrs: Mapping | None = None) -> ir.Value:
        """Add one node named `{scope}/{op_type}` (suffixed `_1`, `_2`... when the scope repeats an op)."""
        name = self._unique(f"{scope}/{op_type}")
        out = self.tape.op(op_type, list(inputs), dict(attrs) if attrs else None, name=name)
        out.name = f"{name}_output_0"
        return out

    def op_multi(self, scope: str, op_type: str, inputs: Sequence[ir.Value], n: int, attrs: Mapping | None = None):
        name = self._unique(f"{scope}/{op_type}")
        outs = self.tape.op_multi_out(op_type, list(inputs), dict(attrs) if attrs else None, num_outputs=n, name=name)
        for i, out in enumerate(outs):
            out.name = f"{name}_output_{i}"
        return outs

    def model(self) -> ir.Model:
        graph = ir.Graph(
            self.inputs,
            self.outputs,
            nodes=self.tape.nodes,
            initializers=list(self._initializers.values()),
            opset_imports={"": OPSET},
            name=self.name,
        )
        return ir.Model(graph, ir_version=IR_VERSION, producer_name="edgekit")

    def _unique(self, name: str) -> str:
        candidate, i = name, 0
        while candidate in self._node_names:
            i += 1
            candidate = f"{name}_{i}"
        self._node_names.add(candidate)
        return candidate
