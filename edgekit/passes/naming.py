"""Unique names for the nodes a pass adds, whatever the graph did with its own.

Why: many exporters leave node names empty, so a name derived from the node it replaces (`f"{node.name}_Q4"`)
is `_Q4` for every one of them, and ONNX Runtime refuses a model with two nodes of one name. A `NodeNames` reads
the names the graph already holds once (its name authority's record: every node of the main graph and its
subgraphs), then hands out the preferred name, or that name with the first free `_N` suffix, and remembers it.
The preferred name is built from something unique in its own right (a weight's initializer name) so that the
result still says which weight a node belongs to.
"""

from __future__ import annotations

import onnx_ir as ir


class NodeNames:
    """The node names of `graph` (subgraphs included) and the ones handed out since."""

    def __init__(self, graph: ir.Graph):
        self._used = {n.name for n in graph.all_nodes() if n.name}
        self._counter: dict[str, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._used

    def take(self, preferred: str) -> str:
        """`preferred` if no node has it, else `preferred_1`, `preferred_2`...; recorded either way."""
        base = preferred or "node"
        name = base
        while name in self._used:
            self._counter[base] = self._counter.get(base, 0) + 1
            name = f"{base}_{self._counter[base]}"
        self._used.add(name)
        return name


def name_nodes(model: ir.Model) -> int:
    """Give every unnamed node of `model` a unique name (`<op_type>`, `<op_type>_1`...) and make duplicate node
    names unique, with onnx-ir's `NameFixPass`; returns how many nodes were unnamed or duplicated before."""
    from onnx_ir.passes.common.naming import NameFixPass

    seen: set[str] = set()
    bad = 0
    for node in model.graph.all_nodes():
        if not node.name or node.name in seen:
            bad += 1
        seen.add(node.name or "")
    if bad:
        NameFixPass(_OpTypeNames())(model)
    return bad


class _OpTypeNames:
    """Node names from the op type (`MatMul`, `MatMul_3`) rather than onnx-ir's generic `node`."""

    def generate_node_name(self, node: ir.Node) -> str:
        return node.name or node.op_type

    def generate_value_name(self, value: ir.Value) -> str:
        return value.name or "v"
