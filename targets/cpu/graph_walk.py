"""Reading the portable decoder's structure back: the few questions the cpu lowering asks of a node.

The lowering finds attention, RoPE and RMSNorm by walking from values it can name (graph outputs, weights)
through the ops `edgekit.export.decoder` writes, checking each op on the way. A graph that differs (a user's own
export, a pass that rewrote attention) is refused with the node where the walk stopped, never lowered into
something that computes other numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from edgekit.passes.base import PassPreconditionError


class NotPortable(PassPreconditionError):
    """The decoder is not laid out as edgekit's portable export: the cpu lowering cannot take it."""

    code = "cpu_lowering"


def const(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant (an initializer or a `Constant` node's tensor), None when it is computed."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def producer(value: ir.Value | None, op_type: str, where: str) -> ir.Node:
    """The node that makes `value`, refused unless it is a default-domain `op_type`."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        got = "a graph input or constant" if node is None else f"{node.op_type} ({node.name})"
        name = value.name if value is not None else None
        raise NotPortable(f"{where}: expected {op_type} to make {name!r}, found {got}")
    return node


def arg(node: ir.Node, index: int, where: str) -> ir.Value:
    """`node.inputs[index]`, refused when the input is left out."""
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None:
        raise NotPortable(f"{where}: {node.op_type} ({node.name}) has no input {index}")
    return value


def made_by(value: ir.Value, where: str) -> ir.Node:
    """The node that makes `value` (whatever its op), refused for a graph input or initializer."""
    node = value.producer()
    if node is None:
        raise NotPortable(f"{where}: {value.name!r} is not made by a node")
    return node


def users(value: ir.Value, op_type: str) -> list[ir.Node]:
    """Default-domain `op_type` nodes that read `value`, in no particular order, each once."""
    seen: dict[int, ir.Node] = {}
    for use in value.uses():
        node = use.node
        if node.op_type == op_type and node.domain in ("", "ai.onnx"):
            seen[id(node)] = node
    return list(seen.values())


def only_user(value: ir.Value, op_type: str, where: str) -> ir.Node:
    found = users(value, op_type)
    if len(found) != 1:
        raise NotPortable(f"{where}: expected one {op_type} reading {value.name!r}, found {len(found)}")
    return found[0]


def ints(node: ir.Node, attr: str) -> list[int] | None:
    a = node.attributes.get(attr)
    return None if a is None else list(a.as_ints())


def const_ints(value: ir.Value | None, where: str) -> list[int]:
    array = const(value)
    if array is None:
        raise NotPortable(f"{where}: {value.name if value is not None else None!r} should be a constant")
    return [int(x) for x in np.asarray(array).reshape(-1)]


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise NotPortable(message)


def named(node: ir.Node) -> ir.Node:
    """`node` with its outputs named after it, as the exporter names them (`{node}_output_{i}`)."""
    for i, out in enumerate(node.outputs):
        out.name = f"{node.name}_output_{i}"
    return node


def first_reader(graph: ir.Graph, values: Sequence[ir.Value]) -> ir.Node:
    """The earliest node, in graph order, reading any of `values` (where a replacement must go before)."""
    readers = {id(u.node) for v in values for u in v.uses()}
    for node in graph:
        if id(node) in readers:
            return node
    raise NotPortable(f"nothing reads {[v.name for v in values]}")
