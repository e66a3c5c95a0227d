"""Typed access to onnx-ir values where a graph's op guarantees them.

onnx-ir types a node's inputs as `Value | None` (an optional input left out is None), a value's name as
`str | None` and its constant as `TensorProtocol | None`. Where the op at hand always has the input, the name
or the constant (a MatMul's two inputs, an initializer's data), these say so once and fail with the node's name
instead of an AttributeError on None.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


class MissingValueError(ValueError):
    """A graph lacks an input, a name or a constant that its op should have."""


def input_of(node: ir.Node, index: int) -> ir.Value:
    """`node.inputs[index]`, which must be present."""
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None:
        raise MissingValueError(f"{node.op_type} node {node.name!r} has no input {index}")
    return value


def name_of(value: ir.Value) -> str:
    """A value's name, which every value in a named graph has."""
    if value.name is None:
        raise MissingValueError(f"an unnamed value (produced by {value.producer()!r})")
    return value.name


def const_array(value: ir.Value) -> np.ndarray:
    """A constant value's data (an initializer or a folded constant)."""
    tensor = value.const_value
    if tensor is None:
        raise MissingValueError(f"value {value.name!r} is not a constant")
    return tensor.numpy()
