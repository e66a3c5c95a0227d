"""The lowering of one graph: patterns first, then one-to-one instructions, then host partitions.

Why this order: a pattern (`lower_attention`, `lower_matmul`, `lower_vector`) claims a whole block of small ONNX
ops for one fused X1 instruction group, anchored at the block's last node so the groups stay in graph order;
what no pattern claims lowers op by op (`GENERIC`), except a folded constant (`graph_view`: a DequantizeLinear of
initializers), which needs no instruction; what the X1 has no instruction for runs on the host (or is refused
under `strict`).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir
from onnx import helper, numpy_helper

from edgekit.errors import EdgekitError

from .graph_view import GraphView, attrs, name, names
from .lower_attention import try_attention, try_rope
from .lower_matmul import try_conv, try_gemm
from .lower_vector import try_gelu, try_rmsnorm, try_silu_mul
from .machine import Machine

# ONNX op -> ISA mnemonic for the one-to-one lowering (the emulator implements each op type's semantics).
GENERIC = {
    "Add": "VADD",
    "Sub": "VADD",
    "Mul": "VMUL",
    "Div": "VMUL",
    "Neg": "VXMAD.F16",
    "Sqrt": "VXMAD.F16",
    "Reciprocal": "VXMAD.F16",
    "Cos": "VXMAD.F16",
    "Sin": "VXMAD.F16",
    "Erf": "VXMAD.F16",
    "Tanh": "VXMAD.F16",
    "Sigmoid": "VXMAD.F16",
    "Exp": "VXMAD.F16",
    "Pow": "VXMAD.F16",
    "ReduceMean": "VADD",
    "ReduceSum": "VADD",
    "ReduceMax": "VADD",
    "Reshape": "VCOPY",
    "Unsqueeze": "VCOPY",
    "Squeeze": "VCOPY",
    "Flatten": "VCOPY",
    "Identity": "VCOPY",
    "Transpose": "VTRANSPOSE",
    "Concat": "VCOPY",
    "Split": "VCOPY",
    "Gather": "VCOPY",
    "Slice": "VCOPY",
    "Expand": "VCOPY",
    "Shape": "VCOPY",
    "Range": "VCOPY",
    "Cast": "VCOPY",
    "ConstantOfShape": "VCOPY",
    "LessOrEqual": "VADD",
    "Less": "VADD",
    "Greater": "VADD",
    "Equal": "VADD",
    "And": "VMUL",
    "Or": "VADD",
    "Not": "VXMAD.F16",
    "Where": "VCOPY",
    "Softmax": "VSOFTMAX",
    "LayerNormalization": "VLAYERNORM",
    "MatMul": "XL_VMATMUL_CAUSAL",
}

Group = tuple[str, list[tuple[str, dict]]]  # (symbol: the anchor node's name, [(mnemonic, attr)])
# tried on each node in this order; the first that matches claims its block
PATTERNS = (try_attention, try_gemm, try_rmsnorm, try_silu_mul, try_rope, try_gelu, try_conv)


class CompileError(EdgekitError):
    """A graph the X1 compiler refuses (strict mode: a node it cannot lower)."""


class Lowering:
    """Walks one graph in order and emits instruction groups, collecting the program's weights, host partitions
    and fusion counts on the way."""

    def __init__(self, g: GraphView, machine: Machine, strict: bool, graph_name: str):
        self.g, self.m, self.strict, self.graph_name = g, machine, strict, graph_name
        self.done: set[ir.Node] = set()
        self.anchor: dict[ir.Node, Group] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.weight_space: dict[str, str] = {}
        self.host: list[dict] = []
        self.host_models: list[bytes] = []
        self.fused: dict[str, int] = defaultdict(int)
        self.kv_outputs: dict[int, tuple[str, str]] = {}

    # -- weights ---------------------------------------------------------------------------------------------
    def add_const(self, v: ir.Value, space: str = "ACT") -> str:
        """A constant operand (norm weight, bias, shape literal) stored in the program, fp32 / int64 as given."""
        key = f"const:{v.name}"
        if key not in self.weights:
            arr = np.asarray(self.g.array(v))
            if arr.dtype == np.float64:
                arr = arr.astype(np.float32)
            if arr.dtype.kind not in "fiub":
                arr = arr.astype(np.float32)
            self.weights[key] = np.array(arr, order="C")  # keeps 0-d scalars 0-d
            self.weight_space[key] = space
        return key

    def add_matrix_int(self, wname: str, q_kn: np.ndarray, scales_gn: np.ndarray, bits: int) -> dict:
        """INT4: unsigned nibbles u = q + 8, column-major by output column then group (numerics.md); FP16 scales."""
        k, n = q_kn.shape
        group = k // scales_gn.shape[0]
        col = np.ascontiguousarray(q_kn.T.astype(np.int16))  # (N, K)
        if bits == 4:
            u = (col + 8).astype(np.uint8)
            packed = (u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)
        else:
            packed = col.astype(np.int8)
        self.weights[f"{wname}.q"] = np.ascontiguousarray(packed)
        self.weights[f"{wname}.s"] = np.ascontiguousarray(scales_gn.T.astype(np.float16))  # (N, G)
        self.weight_space[f"{wname}.q"] = self.weight_space[f"{wname}.s"] = "NMW"
        return {"weight": wname, "k": int(k), "n": int(n), "group": int(group), "bits": bits}

    def add_matrix_f16(self, wname: str, w_kn: np.ndarray) -> dict:
        self.weights[f"{wname}.w"] = np.ascontiguousarray(w_kn.astype(np.float16))
        self.weight_space[f"{wname}.w"] = "NMW"
        k, n = w_kn.shape
        return {"weight": wname, "k": int(k), "n": int(n), "bits": 16}

    # -- patterns --------------------------------------------------------------------------------------------
    def emit(self, anchor: ir.Node, consumed: list[ir.Node], instrs: list[tuple[str, dict]], kind: str) -> None:
        """A pattern matched: `consumed` are lowered, and `instrs` take the anchor's place in graph order."""
        self.done.update(consumed)
        self.anchor[anchor] = (name(anchor), instrs)
        self.fused[kind] += 1

    # -- generic / host --------------------------------------------------------------------------------------
    def generic(self, n: ir.Node) -> Group:
        g = self.g
        if n.op_type in GENERIC:
            attr: dict = {"op": n.op_type, "attrs": attrs(n), "in": names(n.inputs), "out": names(n.outputs)}
            for i in n.inputs:
                if g.is_const(i):
                    attr.setdefault("const", {})[name(i)] = self.add_const(i)
            return name(n), [(GENERIC[n.op_type], attr)]
        if self.strict:
            raise CompileError(
                f"node '{n.name}' (op type {n.op_type}) cannot be lowered to X1 instructions "
                f"(--strict refuses host partitions)",
                self.graph_name,
            )
        return name(n), [("HOSTCALL", self.host_partition(n))]

    def host_partition(self, n: ir.Node) -> dict:
        """A one-node ONNX model for ONNX Runtime; its constant inputs travel inside it."""
        g = self.g
        inits, inputs = [], []
        for i in n.inputs:
            if i is None:
                continue
            if g.is_const(i):
                inits.append(numpy_helper.from_array(np.asarray(g.array(i)), name(i)))
            else:
                inputs.append(helper.make_tensor_value_info(name(i), g.dtype(name(i)), None))
        outputs = [helper.make_tensor_value_info(name(o), g.dtype(name(o)), None) for o in n.outputs]
        graph = helper.make_graph([ir.serde.serialize_node(n)], f"host_{len(self.host)}", inputs, outputs, inits)
        opsets = [helper.make_opsetid(domain, version) for domain, version in g.model.opset_imports.items()]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = g.model.ir_version
        self.host_models.append(model.SerializeToString())
        part = {
            "partition": len(self.host),
            "node": n.name,
            "op_type": n.op_type,
            "inputs": [i.name for i in inputs],
            "outputs": names(n.outputs),
            "cost": "host: ONNX Runtime CPU, timed at run (HOSTCALL dispatch on the X1 only)",
        }
        self.host.append(part)
        return {"partition": part["partition"], "in": [i.name for i in inputs], "out": names(n.outputs)}

    def lower(self) -> list[Group]:
        for n in self.g.nodes:
            if n in self.done or n.op_type == "Constant":
                continue
            for p in PATTERNS:
                if p(self, n):
                    break
        groups = []
        for n in self.g.nodes:
            if n in self.anchor:
                groups.append(self.anchor[n])
            elif n not in self.done and n.op_type != "Constant":
                if self.g.is_folded(n):  # an array in the program, read by its consumers (graph_view)
                    self.fused["const_fold"] += 1
                    continue
                groups.append(self.generic(n))
        return groups
