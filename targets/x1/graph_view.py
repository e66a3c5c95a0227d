"""One exported ONNX graph as the X1 compiler reads it: onnx-ir values with their producers and uses, constant
arrays, and the shapes and dtypes shape inference gave.

Why onnx-ir: the passes already walk graphs as `ir.Value`s with `producer()` and `uses()`; the compiler reads the
same structure instead of keeping its own producer/consumer maps over protobuf.

Shapes and dtypes are those of the graph after ONNX shape inference (the memory plan sizes tensors by them); a
graph that shape inference cannot handle still compiles, with no shapes at all. An initializer has its tensor's
shape even where the file carries no value_info for it (the protobuf reader this replaced planned such resident
tensors at 0 bytes; graphs written by the passes carry value_info, so their programs are unchanged).

Folded constants: a `DequantizeLinear` whose inputs are all initializers (a patch Conv's kernel, a position table,
an embedding table stored at 4 or 8 bits by the passes), and a `Reshape` of one by a constant shape, are values
known at compile time: `is_const`/`is_init`/`array` answer for them with the dequantized array, so their consumers
lower as they would on a float weight instead of becoming host partitions. A pattern that reads the integers
itself (`lower_matmul.try_gemm`: DequantizeLinear -> MatMul as `XL_GEMM.W4A8`/`W8A8`) still claims its node first;
`Lowering` drops only the folded nodes nothing claimed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TypeGuard

import numpy as np
import onnx
import onnx_ir as ir


def load_graph(path: str | Path) -> GraphView:
    """Read an ONNX file, annotate it with ONNX shape inference (an aid to planning, never required)."""
    proto = onnx.load(str(path))
    annotated = True
    try:
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # shape inference errors have many types; the graph still lowers
        annotated = False
    return GraphView(ir.serde.deserialize_model(proto), annotated)


class GraphView:
    """Constant values, producers, uses, shapes and dtypes of one graph's values, by value or by name."""

    def __init__(self, model: ir.Model, annotated: bool = True):
        self.model, self.graph = model, model.graph
        self.nodes: list[ir.Node] = list(model.graph)
        self.inputs: list[ir.Value] = list(model.graph.inputs)
        self.outputs: list[ir.Value] = list(model.graph.outputs)
        self.values: dict[str, ir.Value] = ir.convenience.create_value_mapping(model.graph)
        self.annotated = annotated
        self._consts: dict[ir.Value, ir.Node] = {n.outputs[0]: n for n in self.nodes if n.op_type == "Constant"}
        self._arrays: dict[ir.Value, np.ndarray] = {}
        self._folded: dict[ir.Value, ir.Node] = {}  # graph order is topological: a chain folds in one sweep
        for n in self.nodes:
            if len(n.outputs) == 1 and (
                (n.op_type == "DequantizeLinear" and all(self.is_init(i) for i in n.inputs if i is not None))
                or (n.op_type == "Reshape" and n.inputs[0] in self._folded and self.is_const(n.inputs[1]))
            ):
                self._folded[n.outputs[0]] = n

    # -- constants -----------------------------------------------------------------------------------------------
    def is_init(self, v: ir.Value | None) -> TypeGuard[ir.Value]:
        """A weight known at compile time: an initializer with its value, or a folded constant."""
        return v is not None and ((v.is_initializer() and v.const_value is not None) or v in self._folded)

    def is_const(self, v: ir.Value | None) -> TypeGuard[ir.Value]:
        """An initializer, a Constant node's output or a folded constant."""
        return v is not None and (v in self._consts or self.is_init(v))

    def is_folded(self, n: ir.Node) -> bool:
        """`n` computes a folded constant (its output is an array at compile time, no instruction needed)."""
        return len(n.outputs) == 1 and self._folded.get(n.outputs[0]) is n

    def array(self, v: ir.Value | None) -> np.ndarray | None:
        """The value of a constant (`is_const`), None for any other value."""
        if not self.is_const(v):
            return None
        if v not in self._arrays:
            if v in self._folded:
                self._arrays[v] = self._fold(self._folded[v])
            elif v in self._consts:
                value = next(iter(self._consts[v].attributes.values())).value
                self._arrays[v] = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            else:
                assert v.const_value is not None  # is_init: an initializer with its value
                arr = v.const_value.numpy()  # onnx-ir marks it little-endian ('<f4'): the same bytes here, but
                # the C kernels take native-order buffers only, so hold it as the native dtype
                native = arr.dtype.newbyteorder("=")
                self._arrays[v] = arr.view(native) if arr.dtype.isnative else arr.astype(native)
        return self._arrays[v]

    def const(self, v: ir.Value | None) -> np.ndarray:
        """The value of `v`, which the caller knows to be a constant (`is_const`)."""
        arr = self.array(v)
        if arr is None:
            raise ValueError(f"{name(v)!r} is not a constant")
        return arr

    def _fold(self, n: ir.Node) -> np.ndarray:
        if n.op_type == "Reshape":
            x = self.const(n.inputs[0])
            shape = [int(d) for d in np.asarray(self.array(n.inputs[1])).reshape(-1)]
            if not attrs(n).get("allowzero", 0):  # 0 copies the input's dim (ONNX Reshape)
                shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
            return np.ascontiguousarray(x.reshape(shape))
        x, scale = (self.const(i) for i in n.inputs[:2])
        zero = self.array(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] is not None else None
        a = attrs(n)
        return dequantize_linear(x, scale, zero, axis=a.get("axis", 1), block=a.get("block_size", 0))

    # -- structure ---------------------------------------------------------------------------------------------
    @staticmethod
    def op(v: ir.Value | None, op_type: str | None = None) -> ir.Node | None:
        """The node producing `v` (of `op_type`, when given)."""
        n = None if v is None else v.producer()
        return n if n is not None and (op_type is None or n.op_type == op_type) else None

    @staticmethod
    def users(v: ir.Value) -> list[ir.Node]:
        """The nodes reading `v`, once per input slot that reads it, in graph order."""
        return [u.node for u in v.uses()]

    @staticmethod
    def only_use(v: ir.Value, node: ir.Node) -> bool:
        """`v` is read by `node` alone and is not a graph output: a pattern may fuse it away."""
        return not v.is_graph_output() and all(u.node is node for u in v.uses())

    # -- annotations -------------------------------------------------------------------------------------------
    def shape(self, name: str) -> list | None:
        """Shape inference's dims (ints, symbolic names, "?" for unnamed), None if it gave none."""
        v = self.values.get(name)
        if not self.annotated or v is None or v.shape is None:
            return None
        return [d if isinstance(d, int) else (d.value or "?") for d in v.shape]

    def dtype(self, name: str, default: int = onnx.TensorProto.FLOAT) -> int:
        """The ONNX element type shape inference gave (`default` if none)."""
        v = self.values.get(name)
        if not self.annotated or v is None or v.dtype is None:
            return default
        return int(v.dtype)

    def is_const_name(self, name: str) -> bool:
        return self.is_const(self.values.get(name))


def name(v: ir.Value | ir.Node | None) -> str:
    """The ONNX name of a value or node ("" for an omitted optional input, as ONNX writes it). A graph read from a
    file names all of them (onnx-ir's None is for values built in memory with no name)."""
    return "" if v is None or v.name is None else v.name


def names(values: Iterable[ir.Value | None]) -> list[str]:
    """ONNX value names of a node's inputs or outputs ("" for an omitted optional input, as ONNX writes it)."""
    return [name(v) for v in values]


def attrs(node: ir.Node) -> dict:
    """A node's attributes as plain JSON values (lists, str, numbers; tensors as nested lists)."""
    out = {}
    for name, a in node.attributes.items():
        v = a.value
        if hasattr(v, "numpy"):
            v = v.numpy().tolist()
        elif isinstance(v, (list, tuple)):
            v = list(v)
        out[name] = v
    return out


def dequantize_linear(
    x: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None, *, axis: int = 1, block: int = 0
) -> np.ndarray:
    """ONNX `DequantizeLinear` (opset 21): per tensor (scalar scale), per axis (1-D scale along `axis`) or blocked
    (`block` > 0: scale shaped like `x` with ceil(dim / block) along `axis`); `(x - zero) * scale` in FP32, in the
    scale's dtype."""
    scale = np.asarray(scale)
    xf = np.asarray(x).astype(np.float32)
    axis = axis % max(xf.ndim, 1)

    def spread(t: np.ndarray) -> np.ndarray:
        t = np.asarray(t).astype(np.float32)
        if t.size == 1:
            return t.reshape(())
        if block:
            return np.repeat(t, block, axis=axis).take(range(xf.shape[axis]), axis=axis)
        return t.reshape([-1 if i == axis else 1 for i in range(xf.ndim)])

    zf = spread(zero) if zero is not None else np.float32(0)
    return ((xf - zf) * spread(scale)).astype(scale.dtype)
