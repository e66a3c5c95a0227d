"""ONNX (after the passes) -> X1 programs: pattern-match the big blocks, lower the rest generically.

Why pattern matching on the exported graphs: the exporter decomposes RMSNorm, RoPE, SiLU, GELU and attention into
small ONNX ops so every consumer reads one op vocabulary; the X1 has fused instructions for exactly those blocks
(isa.md), and running them fused is where its speed and its integer numerics come from. What matches becomes
`XL_GEMM.*`, `VRMSNORM`, `XL_ROPE_ROTATE`, `KVAPPEND + XL_VMATMUL_CAUSAL + VSOFTMAX + XL_VMATMUL_PV`,
`VSILU_MUL`, `VGELU`, `VLAYERNORM`; other ops this compiler knows lower one-to-one to vector/layout instructions;
anything else becomes a host partition (a one-node ONNX model run by ONNX Runtime), or an error under `strict`.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgekit.errors import EdgekitError

from .machine import Machine
from .memplan import nominal_bytes, plan_memory
from .program import ISA_VERSION, Instr, Program, address

GRAPHS = {"vision_encoder": "vision_encoder.onnx", "embed_tokens": "embed_tokens.onnx",
          "decoder": "decoder_model_merged.onnx"}

# ONNX op -> ISA mnemonic for the one-to-one lowering (the emulator implements each op type's semantics).
GENERIC = {
    "Add": "VADD", "Sub": "VADD", "Mul": "VMUL", "Div": "VMUL", "Neg": "VXMAD.F16", "Sqrt": "VXMAD.F16",
    "Reciprocal": "VXMAD.F16", "Cos": "VXMAD.F16", "Sin": "VXMAD.F16", "Erf": "VXMAD.F16", "Tanh": "VXMAD.F16",
    "Sigmoid": "VXMAD.F16", "Exp": "VXMAD.F16", "Pow": "VXMAD.F16", "ReduceMean": "VADD", "ReduceSum": "VADD",
    "ReduceMax": "VADD", "Reshape": "VCOPY", "Unsqueeze": "VCOPY", "Squeeze": "VCOPY", "Flatten": "VCOPY",
    "Identity": "VCOPY", "Transpose": "VTRANSPOSE", "Concat": "VCOPY", "Split": "VCOPY", "Gather": "VCOPY",
    "Slice": "VCOPY", "Expand": "VCOPY", "Shape": "VCOPY", "Range": "VCOPY", "Cast": "VCOPY",
    "ConstantOfShape": "VCOPY", "LessOrEqual": "VADD", "Less": "VADD", "Greater": "VADD", "Equal": "VADD",
    "And": "VMUL", "Or": "VADD", "Not": "VXMAD.F16", "Where": "VCOPY", "Softmax": "VSOFTMAX",
    "LayerNormalization": "VLAYERNORM", "MatMul": "XL_VMATMUL_CAUSAL",
}
LAYER_RE = re.compile(r"layers\.(\d+)/")


class CompileError(EdgekitError):
    """A graph the X1 compiler refuses (strict mode: a node it cannot lower)."""


class _Graph:
    """Producer/consumer maps and constant values of one ONNX graph."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.model, self.nodes = model, list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        self.inputs = [i.name for i in g.input]
        self.outputs = [o.name for o in g.output]
        self.prod: dict[str, onnx.NodeProto] = {}
        self.cons: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        self.consts: dict[str, np.ndarray] = {}
        for n in self.nodes:
            for o in n.output:
                self.prod[o] = n
            for i in n.input:
                if i:
                    self.cons[i].append(n)
            if n.op_type == "Constant":
                self.consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        self._arrays: dict[str, np.ndarray] = {}
        self.shapes: dict[str, list] = {}
        self.dtypes: dict[str, int] = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
            for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
                tt = vi.type.tensor_type
                self.dtypes[vi.name] = tt.elem_type
                if tt.HasField("shape"):
                    self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                                            for d in tt.shape.dim]
        except Exception:  # shape inference is an aid to planning, never required
            pass

    def array(self, name: str) -> np.ndarray | None:
        if name in self.consts:
            return self.consts[name]
        if name in self.inits:
            if name not in self._arrays:
                self._arrays[name] = numpy_helper.to_array(self.inits[name])
            return self._arrays[name]
        return None

    def is_const(self, name: str) -> bool:
        return name in self.consts or name in self.inits

    def op(self, name: str, op_type: str | None = None) -> onnx.NodeProto | None:
        n = self.prod.get(name)
        return n if n is not None and (op_type is None or n.op_type == op_type) else None

    def only_use(self, name: str, node: onnx.NodeProto) -> bool:
        return name not in self.outputs and all(c is node for c in self.cons[name])


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, onnx.TensorProto):
            v = numpy_helper.to_array(v).tolist()
        elif isinstance(v, (list, tuple)):
            v = [x.decode() if isinstance(x, bytes) else x for x in v]
        out[a.name] = v
    return out


class _Lowering:
    """Walks one graph in order and emits instruction groups; `groups` is [(symbol node, [(mnemonic, attr)])]."""

    def __init__(self, g: _Graph, machine: Machine, strict: bool, graph_name: str):
        self.g, self.m, self.strict, self.graph_name = g, machine, strict, graph_name
        self.done: set[int] = set()
        self.anchor: dict[int, tuple[str, list[tuple[str, dict]]]] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.weight_space: dict[str, str] = {}
        self.host: list[dict] = []
        self.host_models: list[bytes] = []
        self.fused: dict[str, int] = defaultdict(int)

    # -- weights ---------------------------------------------------------------------------------------------
    def add_const(self, name: str, space: str = "ACT") -> str:
        """A constant operand (norm weight, bias, shape literal) stored in the program, fp32 / int64 as given."""
        key = f"const:{name}"
        if key not in self.weights:
            arr = np.asarray(self.g.array(name))
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
    def emit(self, anchor: onnx.NodeProto, consumed: list[onnx.NodeProto], instrs: list[tuple[str, dict]],
             kind: str) -> None:
        for n in consumed:
            self.done.add(id(n))
        self.anchor[id(anchor)] = (anchor.name, instrs)
        self.fused[kind] += 1

    def try_gemm(self, n: onnx.NodeProto) -> bool:
        g = self.g
        if n.op_type != "MatMul" or g.is_const(n.input[0]):
            return False
        w = n.input[1]
        consumed = [n]
        dq = g.op(w, "DequantizeLinear")
        tr = g.op(w, "Transpose")
        if dq is not None and g.only_use(w, n) and all(g.inits.get(i) is not None for i in dq.input[:2]) \
                and len(dq.input) == 2 and _attrs(dq).get("axis", 1) == 0:
            q = np.asarray(g.array(dq.input[0])).astype(np.int16)
            s = np.asarray(g.array(dq.input[1]), np.float32)
            bits = 4 if g.inits[dq.input[0]].data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) else 8
            wname = w[:-len(".weight_dq")] if w.endswith(".weight_dq") else n.name
            attr = self.add_matrix_int(wname, q, s, bits)
            mnem = "XL_GEMM.W4A8" if bits == 4 else "XL_GEMM.W8A8"
            consumed.append(dq)
        elif tr is not None and g.only_use(w, n) and g.inits.get(tr.input[0]) is not None \
                and _attrs(tr).get("perm") == [1, 0]:
            wname = tr.input[0][:-len(".weight")] if tr.input[0].endswith(".weight") else n.name
            attr = self.add_matrix_f16(wname, np.asarray(g.array(tr.input[0]), np.float32).T)
            mnem = "XL_GEMM.F16"
            consumed.append(tr)
        elif w in g.inits:
            attr = self.add_matrix_f16(w, np.asarray(g.array(w), np.float32))
            mnem = "XL_GEMM.F16"
        else:
            return False
        out, anchor = n.output[0], n
        adds = g.cons[out]
        if len(adds) == 1 and adds[0].op_type == "Add" and out not in g.outputs:
            other = [i for i in adds[0].input if i != out]
            if len(other) == 1 and other[0] in g.inits and np.asarray(g.array(other[0])).ndim == 1:
                attr["bias"] = self.add_const(other[0])
                anchor, out = adds[0], adds[0].output[0]
                consumed.append(adds[0])
        role = next((r for r in ("q_proj", "o_proj") if f"/{r}/" in n.name), None)
        if role and "/self_attn/" in n.name and "/model/layers." in n.name:
            attr["head_role"] = role
        self.emit(anchor, consumed, [(mnem, {**attr, "in": [n.input[0]], "out": [out]})], "gemm")
        return True

    def try_rmsnorm(self, n: onnx.NodeProto) -> bool:
        g = self.g
        if n.op_type != "ReduceMean":
            return False
        sq = g.op(n.input[0], "Mul")
        if sq is None or sq.input[0] != sq.input[1] or not g.only_use(sq.output[0], n):
            return False
        x = sq.input[0]
        chain, cur = [sq, n], n
        for op in ("Add", "Sqrt", "Reciprocal"):
            nxt = g.cons[cur.output[0]]
            if len(nxt) != 1 or nxt[0].op_type != op:
                return False
            cur = nxt[0]
            chain.append(cur)
        eps_in = [i for i in chain[2].input if i != n.output[0]]
        if len(eps_in) != 1 or not g.is_const(eps_in[0]):
            return False
        nxt = g.cons[cur.output[0]]
        if len(nxt) != 1 or nxt[0].op_type != "Mul" or x not in nxt[0].input:
            return False
        mul1 = nxt[0]
        nxt = g.cons[mul1.output[0]]
        if len(nxt) != 1 or nxt[0].op_type != "Mul":
            return False
        mul2 = nxt[0]
        gamma = [i for i in mul2.input if i != mul1.output[0]]
        if len(gamma) != 1 or gamma[0] not in g.inits:
            return False
        eps = float(np.asarray(g.array(eps_in[0])).reshape(-1)[0])
        self.emit(mul2, [*chain, mul1, mul2], [("VRMSNORM", {"gamma": self.add_const(gamma[0]), "eps": eps,
                                                          "in": [x], "out": [mul2.output[0]]})], "rmsnorm")
        return True

    def try_silu_mul(self, n: onnx.NodeProto) -> bool:
        g = self.g
        if n.op_type != "Sigmoid":
            return False
        x = n.input[0]
        users = g.cons[n.output[0]]
        if len(users) != 1 or users[0].op_type != "Mul" or x not in users[0].input:
            return False
        silu = users[0]
        nxt = g.cons[silu.output[0]]
        if len(nxt) != 1 or nxt[0].op_type != "Mul" or silu.output[0] in g.outputs:
            return False
        up = [i for i in nxt[0].input if i != silu.output[0]]
        if len(up) != 1:
            return False
        self.emit(nxt[0], [n, silu, nxt[0]], [("VSILU_MUL", {"in": [x, up[0]], "out": [nxt[0].output[0]]})],
                  "silu_mul")
        return True

    def try_rope(self, n: onnx.NodeProto) -> bool:
        g = self.g
        if n.op_type != "Split" or len(n.output) != 2:
            return False
        x = n.input[0]
        neg = g.cons[n.output[1]]
        if len(neg) != 1 or neg[0].op_type != "Neg":
            return False
        cat = g.cons[neg[0].output[0]]
        if len(cat) != 1 or cat[0].op_type != "Concat" or list(cat[0].input) != [neg[0].output[0], n.output[0]]:
            return False
        mul_sin = g.cons[cat[0].output[0]]
        if len(mul_sin) != 1 or mul_sin[0].op_type != "Mul":
            return False
        add = g.cons[mul_sin[0].output[0]]
        if len(add) != 1 or add[0].op_type != "Add":
            return False
        other = [i for i in add[0].input if i != mul_sin[0].output[0]][0]
        mul_cos = g.op(other, "Mul")
        if mul_cos is None or x not in mul_cos.input or not g.only_use(other, add[0]):
            return False
        cos = [i for i in mul_cos.input if i != x][0]
        sin = [i for i in mul_sin[0].input if i != cat[0].output[0]][0]
        role = "k" if "rotary_k" in n.name else "q"
        self.emit(add[0], [n, neg[0], cat[0], mul_sin[0], mul_cos, add[0]],
                  [("XL_ROPE_ROTATE", {"role": role, "in": [x, cos, sin], "out": [add[0].output[0]]})], "rope")
        return True

    def try_attention(self, n: onnx.NodeProto) -> bool:
        """Concat(past_key_values.i.key, k) ... Softmax ... MatMul(P, V): the whole GQA block over the KV ring."""
        g = self.g
        if n.op_type != "Concat" or not n.input[0].startswith("past_key_values.") or not n.input[0].endswith(".key"):
            return False
        layer = int(n.input[0].split(".")[1])
        cv = next((c for c in g.cons.get(f"past_key_values.{layer}.value", []) if c.op_type == "Concat"), None)
        if cv is None:
            return False
        pk, pv = n.output[0], cv.output[0]
        tr = [c for c in g.cons[pk] if c.op_type == "Transpose"]
        uv = [c for c in g.cons[pv] if c.op_type == "Unsqueeze"]
        if len(tr) != 1 or len(uv) != 1:
            return False
        uk = g.cons[tr[0].output[0]]
        if len(uk) != 1 or uk[0].op_type != "Unsqueeze":
            return False
        s_mm = g.cons[uk[0].output[0]]
        if len(s_mm) != 1 or s_mm[0].op_type != "MatMul":
            return False
        rq = g.op(s_mm[0].input[0], "Reshape")
        chain = []
        cur = s_mm[0]
        for op in ("Div", "Add", "Softmax", "MatMul"):
            nxt = g.cons[cur.output[0]]
            if len(nxt) != 1 or nxt[0].op_type != op:
                return False
            cur = nxt[0]
            chain.append(cur)
        div, add, soft, pv_mm = chain
        if rq is None or pv_mm.input[1] != uv[0].output[0]:
            return False
        scale = float(np.asarray(g.array(div.input[1])).reshape(-1)[0])
        mask = [i for i in add.input if i != div.output[0]][0]
        q = rq.input[0]
        scores, probs = f"{pv_mm.name}:scores", f"{pv_mm.name}:probs"
        common = {"layer": layer}
        instrs = [
            ("KVEVICT", {**common, "in": [n.input[1]], "out": []}),
            ("KVAPPEND", {**common, "in": [n.input[1], cv.input[1]], "out": []}),
            ("KVLD", {**common, "in": [], "out": []}),
            ("XL_VMATMUL_CAUSAL", {**common, "scale": scale, "in": [q, mask], "out": [scores]}),
            ("VSOFTMAX", {**common, "attn": True, "in": [scores], "out": [probs]}),
            ("XL_VMATMUL_PV", {**common, "in": [probs], "out": [pv_mm.output[0]]}),
        ]
        self.kv_outputs[layer] = (pk, pv)
        self.emit(pv_mm, [n, cv, tr[0], uv[0], uk[0], s_mm[0], rq, *chain], instrs, "attention")
        return True

    def try_gelu(self, n: onnx.NodeProto) -> bool:
        g = self.g
        if n.op_type != "Erf":
            return False
        pre = g.op(n.input[0], "Mul")
        if pre is None or not g.only_use(n.input[0], n):
            return False
        x = [i for i in pre.input if not g.is_const(i)]
        if len(x) != 1:
            return False
        x = x[0]
        add = g.cons[n.output[0]]
        if len(add) != 1 or add[0].op_type != "Add":
            return False
        fin = g.cons[add[0].output[0]]
        if len(fin) != 1 or fin[0].op_type != "Mul":
            return False
        half = g.op([i for i in fin[0].input if i != add[0].output[0]][0], "Mul")
        if half is None or x not in half.input or not g.only_use(half.output[0], fin[0]):
            return False
        self.emit(fin[0], [pre, n, add[0], half, fin[0]], [("VGELU", {"approx": "none", "in": [x],
                                                                       "out": [fin[0].output[0]]})], "gelu")
        return True

    def try_conv(self, n: onnx.NodeProto) -> bool:
        g = self.g
        if n.op_type != "Conv" or n.input[1] not in g.inits:
            return False
        a = _attrs(n)
        w = np.asarray(g.array(n.input[1]), np.float32)
        kh, kw = w.shape[2:]
        if a.get("strides") != [kh, kw] or any(a.get("pads", [0]) ) or a.get("group", 1) != 1 \
                or any(d != 1 for d in a.get("dilations", [1, 1])):
            return False
        attr = self.add_matrix_f16(n.input[1], w.reshape(w.shape[0], -1).T)
        attr["im2col"] = [int(kh), int(kw)]
        if len(n.input) > 2 and n.input[2]:
            attr["bias"] = self.add_const(n.input[2])
        self.emit(n, [n], [("XL_GEMM.F16", {**attr, "in": [n.input[0]], "out": [n.output[0]]})], "conv")
        return True

    # -- generic / host --------------------------------------------------------------------------------------
    def generic(self, n: onnx.NodeProto) -> tuple[str, list[tuple[str, dict]]]:
        g = self.g
        if n.op_type in GENERIC:
            attr = {"op": n.op_type, "attrs": _attrs(n), "in": list(n.input), "out": list(n.output)}
            for i in n.input:
                if i and g.is_const(i):
                    attr.setdefault("const", {})[i] = self.add_const(i)
            return n.name, [(GENERIC[n.op_type], attr)]
        if self.strict:
            raise CompileError(f"node '{n.name}' (op type {n.op_type}) cannot be lowered to X1 instructions "
                               f"(--strict refuses host partitions)", self.graph_name)
        return n.name, [("HOSTCALL", self.host_partition(n))]

    def host_partition(self, n: onnx.NodeProto) -> dict:
        """A one-node ONNX model for ONNX Runtime; its constant inputs travel inside it."""
        g = self.g
        inits, inputs = [], []
        for i in n.input:
            if not i:
                continue
            if g.is_const(i):
                inits.append(numpy_helper.from_array(np.asarray(g.array(i)), i))
            else:
                dt = g.dtypes.get(i, onnx.TensorProto.FLOAT)
                inputs.append(helper.make_tensor_value_info(i, dt, None))
        outputs = [helper.make_tensor_value_info(o, g.dtypes.get(o, onnx.TensorProto.FLOAT), None) for o in n.output]
        graph = helper.make_graph([n], f"host_{len(self.host)}", inputs, outputs, inits)
        model = helper.make_model(graph, opset_imports=list(g.model.opset_import))
        model.ir_version = g.model.ir_version
        self.host_models.append(model.SerializeToString())
        part = {"partition": len(self.host), "node": n.name, "op_type": n.op_type,
                "inputs": [i.name for i in inputs], "outputs": list(n.output),
                "cost": "host: ONNX Runtime CPU, timed at run (HOSTCALL dispatch on the X1 only)"}
        self.host.append(part)
        return {"partition": part["partition"], "in": [i.name for i in inputs], "out": list(n.output)}

    def lower(self) -> list[tuple[str, list[tuple[str, dict]]]]:
        self.kv_outputs: dict[int, tuple[str, str]] = {}
        for n in self.g.nodes:
            if id(n) in self.done or n.op_type == "Constant":
                continue
            for p in (self.try_attention, self.try_gemm, self.try_rmsnorm, self.try_silu_mul, self.try_rope,
                      self.try_gelu, self.try_conv):
                if p(n):
                    break
        groups = []
        for n in self.g.nodes:
            if id(n) in self.anchor:
                groups.append(self.anchor[id(n)])
            elif id(n) not in self.done and n.op_type != "Constant":
                groups.append(self.generic(n))
        return groups


def compile_graph(path: str | Path, machine: Machine, *, strict: bool = False, graph_name: str | None = None,
                  plan_seq: int = 64) -> Program:
    """One ONNX file -> one Program."""
    path = Path(path)
    start = time.perf_counter()
    try:
        model = onnx.load(str(path))
    except Exception as err:  # protobuf decode errors have many types
        raise CompileError(f"cannot read ONNX graph ({type(err).__name__})", path) from err
    g = _Graph(model)
    low = _Lowering(g, machine, strict, graph_name or path.name)
    try:
        groups = low.lower()
    except CompileError as err:
        raise CompileError(err.reason, path) from None

    tensor_ids: dict[str, int] = {}
    tensors: list[dict] = []
    uses: dict[int, tuple[int, int]] = {}

    def tid(name: str, index: int) -> int:
        if name not in tensor_ids:
            tensor_ids[name] = len(tensors)
            dt = g.dtypes.get(name, onnx.TensorProto.FLOAT)
            nbytes = 8 if dt == onnx.TensorProto.INT64 else (1 if dt == onnx.TensorProto.BOOL else 4)
            const = g.is_const(name)
            tensors.append({"name": name, "shape": g.shapes.get(name), "resident": const,
                            "space": "NMW" if const else "ACT",
                            "bytes": nominal_bytes(g.shapes.get(name), nbytes, plan_seq)})
        i = tensor_ids[name]
        f, _ = uses.get(i, (index, index))
        uses[i] = (f, index)
        return i

    instrs, attrs, symbols = [], [], {}
    for name in g.inputs:
        tid(name, 0)
    for symbol, group in groups:
        for mnem, attr in group:
            idx = len(instrs)
            ins_ids = [tid(v, idx) for v in attr.get("in", []) if v]
            out_ids = [tid(v, idx) for v in attr.get("out", []) if v]
            layer = attr.get("layer")
            if layer is None:
                m = LAYER_RE.search(symbol)
                layer = int(m.group(1)) if m else None
            attr = {**attr, "layer": layer, "in_ids": ins_ids, "out_ids": out_ids}
            attrs.append(attr)
            refs = [address("ACT", t) for t in (ins_ids + out_ids)[:6]]
            instrs.append(Instr(mnem, (len(attrs) - 1, *refs)))
            symbols[idx] = symbol
    end = len(instrs)
    for name in g.outputs:
        if name in tensor_ids:
            tid(name, end)
    instrs.append(Instr("END"))
    plan = plan_memory(tensors, uses, int((machine.sram.banks - machine.sram.kv_banks) * machine.bank_bytes))
    io = {"inputs": [{"name": i.name, "shape": g.shapes.get(i.name), "dtype": int(i.type.tensor_type.elem_type)}
                     for i in model.graph.input],
          "outputs": [{"name": o.name, "shape": g.shapes.get(o.name), "dtype": int(o.type.tensor_type.elem_type)}
                      for o in model.graph.output],
          "kv_outputs": {str(k): list(v) for k, v in low.kv_outputs.items()}}
    counts = defaultdict(int)
    for ins in instrs:
        counts[ins.mnemonic] += 1
    meta = {"graph": graph_name or path.stem, "source": path.name, "compile_seconds": time.perf_counter() - start,
            "instructions": dict(counts), "fused": dict(low.fused), "host_partitions": len(low.host),
            "onnx_nodes": len(g.nodes)}
    header = {"magic": "EKX1PRG", "isa_version": ISA_VERSION, "machine_hash": machine.hash}
    return Program(header, instrs, symbols, io, attrs, low.weights, low.weight_space, plan, low.host,
                   low.host_models, meta)


def compile_model(model_dir: str | Path, machine: Machine, *, strict: bool = False) -> dict[str, Program]:
    """The graphs present in `model_dir` -> {"vision_encoder" | "embed_tokens" | "decoder": Program}."""
    model_dir = Path(model_dir)
    out = {}
    for role, fname in GRAPHS.items():
        if (model_dir / fname).is_file():
            out[role] = compile_graph(model_dir / fname, machine, strict=strict, graph_name=role)
    if not out:
        raise CompileError(f"no ONNX graphs ({', '.join(GRAPHS.values())}) to compile", model_dir)
    return out
