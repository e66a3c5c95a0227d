"""ONNX files edgekit did not write: read one (or refuse it in one line), name its nodes, raise its opset.

Why a module of its own: edgekit's own graphs come from its exporter with every node named, opset 21 and the
graph roles of `names.py`; a user's file from torch.onnx, tf2onnx or onnx.helper may have none of that. The
passes should not each guess, so a file goes through here first: `load_onnx` refuses what is not a readable
model naming the file (external data missing or short included), `name_nodes` gives every unnamed or
duplicated node a unique name (onnx-ir's `NameFixPass`), and `upgrade_opset` raises the default-domain opset
with ONNX's version converter when a pass writes an op that needs it (blocked `DequantizeLinear`: opset 21,
INT4 tensors: IR version 10), keeping each weight tensor as it was (memory-mapped external data included).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.export.save import check_external_data

__all__ = ["NodeNames", "default_opset", "has_external_data", "load_onnx", "name_nodes", "upgrade_opset"]


def load_onnx(path: str | Path) -> ir.Model:
    """The model in `path`, its external data checked (not read); a `ConfigError` naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("ONNX file not found", path)
    try:
        model = ir.load(path)
    except Exception as exc:  # protobuf's DecodeError and friends: a user's file that is not a model
        raise ConfigError(f"not a readable ONNX model ({type(exc).__name__}: {str(exc)[:120]})", path) from exc
    check_external_data(model, path)
    if not len(model.graph):
        raise ConfigError("the graph has no nodes", path)
    if not model.graph.outputs:
        raise ConfigError("the graph declares no outputs", path)
    return model


def has_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def default_opset(model: ir.Model) -> int | None:
    return model.graph.opset_imports.get("", model.graph.opset_imports.get("ai.onnx"))


def upgrade_opset(model: ir.Model, version: int, where: str | Path | None = None) -> ir.Model:
    """`model` at default-domain opset >= `version` (and IR version >= 10 from opset 21): the same object when
    it already is, else a converted copy whose initializers are the original tensor objects (external weights
    are never read). A graph ONNX's converter cannot carry across is refused in one line."""
    current = default_opset(model)
    if current is None or current >= version:
        return model
    tensors = {name: v.const_value for name, v in model.graph.initializers.items()}
    # external tensors serialize as references (nothing is read); the originals go back in below
    proto = ir.to_proto(model)
    try:
        converted = onnx.version_converter.convert_version(proto, version)
    except Exception as exc:  # the converter's own errors name the op it could not adapt
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot upgrade opset {current} to {version}, which this pass needs ({first})", where
        ) from exc
    new = ir.from_proto(converted)
    for name, value in new.graph.initializers.items():
        if name in tensors:
            value.const_value = tensors[name]
    new.ir_version = max(new.ir_version or 0, 10 if version >= 21 else 8)
    return new


# --------------------------------------------------------------------------------------------------------------
# node names. Many exporters leave node names empty, so a name derived from the node a pass replaces
# (`f"{node.name}_Q4"`) is `_Q4` for every one of them, and ONNX Runtime refuses a model with two nodes of one
# name. A `NodeNames` reads the names the graph already holds once (every node of the main graph and its
# subgraphs), then hands out the preferred name, or that name with the first free `_N` suffix, and remembers
# it. Passes build the preferred name from something unique in its own right (a weight's initializer name).
# --------------------------------------------------------------------------------------------------------------
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
