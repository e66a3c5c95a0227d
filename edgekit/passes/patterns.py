"""The graph shapes weight passes look for, and the few edits they all make.

Why one module: INT4, INT8, FP16, sparsity, head pruning and LoRA all start from the same question ("which MatMuls
multiply by a constant weight, and in which layout?") and end with the same edits (a new uniquely named
initializer, a folded Transpose dropped). Answering it once means the passes cannot disagree about which weights
a model has.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
import onnx_ir as ir

from edgekit.ir_values import MissingValueError, const_array, input_of, name_of

from .base import PassPreconditionError


def shape_of(value: ir.Value) -> ir.Shape:
    """The shape of a value that has one (an initializer, an output this module typed); else `MissingValueError`."""
    if value.shape is None:
        raise MissingValueError(f"value {value.name!r} has no shape")
    return value.shape


def dtype_of(value: ir.Value) -> ir.DataType:
    """The element type of a value that has one (an initializer, an output this module typed); else
    `MissingValueError`."""
    if value.dtype is None:
        raise MissingValueError(f"value {value.name!r} has no element type")
    return value.dtype


def static_dim(value: ir.Value, axis: int) -> int:
    """The size of `value` along `axis` when the graph fixes it (an initializer's, a KV input's head count);
    a value with no shape, or a symbolic size there, is a `PassPreconditionError` naming both."""
    shape = value.shape
    size = shape[axis] if shape is not None else None
    if not isinstance(size, int):
        raise PassPreconditionError(f"{value.name!r} has no fixed size on axis {axis} (shape {shape})")
    return size


@dataclass
class WeightMatMul:
    """A MatMul whose B input is a constant weight, either an initializer (K, N) or `Transpose(initializer)` of
    an (N, K) Hugging Face `nn.Linear` weight. `name` is the weight's module name (`model.layers.0.mlp.up_proj`)."""

    node: ir.Node
    weight: ir.Value  # the initializer
    transpose: ir.Node | None  # the Transpose between them, if any

    @property
    def name(self) -> str:
        n = self.weight.name or ""
        return n[: -len(".weight")] if n.endswith(".weight") else n

    @property
    def weight_name(self) -> str:
        """The initializer's name (every initializer has one)."""
        return name_of(self.weight)

    @property
    def activation(self) -> ir.Value:
        return input_of(self.node, 0)

    def kn(self) -> np.ndarray:
        """The weight as MatMul consumes it, (K, N) float32."""
        w = const_array(self.weight)
        return np.asarray(w.T if self.transpose is not None else w, dtype=np.float32)

    @property
    def k(self) -> int:
        return static_dim(self.weight, 1 if self.transpose is not None else 0)

    @property
    def n(self) -> int:
        return static_dim(self.weight, 0 if self.transpose is not None else 1)


def _is_float_initializer(v: ir.Value | None) -> TypeGuard[ir.Value]:
    return (
        v is not None
        and v.const_value is not None
        and v.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16)
        and v.shape is not None
        and len(v.shape) == 2
    )


def find_weight_matmuls(model: ir.Model) -> list[WeightMatMul]:
    """Every MatMul in the main graph fed by a constant 2-D float weight, in graph order."""
    out = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        b = node.inputs[1]
        producer = b.producer() if b is not None else None
        if _is_float_initializer(b) and b.is_initializer():
            out.append(WeightMatMul(node, b, None))
        elif (
            producer is not None
            and producer.op_type == "Transpose"
            and producer.domain in ("", "ai.onnx")
            and _is_float_initializer(producer.inputs[0])
            and producer.inputs[0].is_initializer()
        ):
            perm = producer.attributes.get("perm")
            if perm is None or list(perm.as_ints()) == [1, 0]:
                out.append(WeightMatMul(node, producer.inputs[0], producer))
    return out


def require_weight_matmuls(model: ir.Model, pass_name: str, graph: str = "") -> list[WeightMatMul]:
    """`find_weight_matmuls`, refusing (as a precondition) a graph that has none."""
    found = find_weight_matmuls(model)
    if not found:
        where = f" in {graph}" if graph else ""
        raise PassPreconditionError(f"{pass_name}: no MatMul with a constant weight to quantize{where}", graph or None)
    return found


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    """Whether a module name matches one of the fnmatch `patterns` (`lm_head`, `model.layers.0.*`)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def add_initializer(graph: ir.Graph, array: np.ndarray, name: str) -> ir.Value:
    """Register `array` as an initializer named `name`, or `name_1`, `name_2`... when that is taken."""
    base, i = name, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    tensor = ir.Tensor(array, name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=None, const_value=tensor)
    value.dtype = tensor.dtype
    graph.register_initializer(value)
    return value


def remove_if_unused(model: ir.Model, node: ir.Node | None) -> int:
    """Drop `node` (e.g. a folded Transpose) once nothing reads its outputs; returns nodes removed (0 or 1)."""
    if node is None or node.graph is None:
        return 0
    if any(o.uses() or o.is_graph_output() for o in node.outputs):
        return 0
    inputs = list(node.inputs)
    model.graph.remove(node, safe=True)
    for v in inputs:  # an initializer nobody reads any more goes too
        if v is not None and v.is_initializer() and not v.uses() and not v.is_graph_output():
            model.graph.initializers.pop(name_of(v), None)
    return 1
