"""Binding of the instructions that carry an ONNX op's own semantics: the generic one-to-one lowering (vector or
layout cost by output size), constant-shape layout ops bound to their numpy call, and host partitions run by
ONNX Runtime."""

from __future__ import annotations

import time

import numpy as np

from .onnx_ops import BINARY_UFUNC, FREE_OPS, GENERIC_FN, MULTI_OUT


def generic(binder, attr, ins, outs, layer):
    """numpy semantics of the ONNX op; vector or layout costs by output size."""
    op, a = attr["op"], attr["attrs"]
    fast = layout(binder, op, a, attr, ins, outs)
    if fast is not None:
        return fast
    compute = _compute(op, a)
    if op in FREE_OPS:
        return _free(compute, ins, outs)
    if op == "MatMul":
        return _matmul(binder.costs, compute, ins, outs, layer)
    ops = {"Softmax": binder.v.softmax_ops, "LayerNormalization": binder.v.rmsnorm_ops}.get(op, binder.v.residual_ops)
    priced = (binder.costs, op, layer, ops)  # a vector op's cost entry is costs.vector(op, layer, size, ops)
    if op in BINARY_UFUNC and len(ins) == 2 and not a and len(outs) == 1:
        return _binary(BINARY_UFUNC[op], ins, outs[0], priced)
    if len(outs) == 1:
        return _vector1(compute, ins, outs[0], priced)
    return _vector(compute, ins, outs, priced)


def _compute(op, a):
    """The op's numpy semantics on a list of arguments, returning its outputs as a list (an FP64 result narrowed
    to FP32, except from Shape, Range and Cast)."""
    if op == "Concat":
        axis = a.get("axis", 0)

        def concat(args):
            return [np.concatenate(args, axis=axis)]

        return concat
    f = GENERIC_FN[op]
    multi, widen = op in MULTI_OUT, op not in ("Shape", "Range", "Cast")

    def compute(args):
        r = f(*args, **a)
        y = list(r) if multi else [r]
        if widen and isinstance(y[0], np.ndarray) and y[0].dtype == np.float64:
            y = [y[0].astype(np.float32)]
        return y

    return compute


def _free(compute, ins, outs):
    def free(store, ctx):
        for i, o in zip(outs, compute([store[i] for i in ins])):
            store[i] = o

    return free


def _matmul(costs, compute, ins, outs, layer):
    def matmul(store, ctx):
        args = [store[i] for i in ins]
        y = compute(args)
        for i, o in zip(outs, y):
            store[i] = o
        return costs.act_matmul(layer, int(np.size(y[0])), args[0].shape, args[1].shape)

    return matmul


# The vector ops below keep their cost entries by output size in their own `table`, each built once.


def _binary(ufunc, ins, o0, priced):
    (a_id, b_id), (costs, op, layer, ops) = ins, priced
    table: dict = {}

    def binary(store, ctx):  # `compute` for Add/Sub/Mul, without its argument lists
        y = ufunc(store[a_id], store[b_id])
        if isinstance(y, np.ndarray) and y.dtype == np.float64:
            y = y.astype(np.float32)
        store[o0] = y
        size = int(np.size(y))
        e = table.get(size)
        if e is None:
            e = table[size] = costs.vector(op, layer, size, ops)
        return e

    return binary


def _vector1(compute, ins, o0, priced):
    costs, op, layer, ops = priced
    table: dict = {}

    def vector1(store, ctx):
        y = compute([store[i] for i in ins])
        y0 = store[o0] = y[0]
        size = int(np.size(y0))
        e = table.get(size)
        if e is None:
            e = table[size] = costs.vector(op, layer, size, ops)
        return e

    return vector1


def _vector(compute, ins, outs, priced):
    costs, op, layer, ops = priced
    table: dict = {}

    def vector(store, ctx):
        y = compute([store[i] for i in ins])
        for i, o in zip(outs, y):
            store[i] = o
        size = int(np.size(y[0]))
        e = table.get(size)
        if e is None:
            e = table[size] = costs.vector(op, layer, size, ops)
        return e

    return vector


def layout(binder, op, a, attr, ins, outs):
    """Reshape to a constant shape and Transpose: the numpy call the generic path ends in, bound directly."""
    if op == "Reshape" and len(attr["in"]) == 2 and attr["in"][1] in attr.get("const", {}):
        shape = [int(v) for v in np.asarray(binder.program.weights[attr["const"][attr["in"][1]]]).reshape(-1)]
        if not (0 in shape and not a.get("allowzero", 0)):  # else 0 copies the input's dim: below
            shape_t, x_id, y_id = tuple(shape), ins[0], outs[0]

            def reshape(store, ctx):
                store[y_id] = store[x_id].reshape(shape_t)

            return reshape
    if (
        op in ("Reshape", "Unsqueeze", "Squeeze", "Flatten")
        and len(outs) == 1
        and all(n in attr.get("const", {}) for n in attr["in"][1:] if n)
    ):
        return reshape_by_input_shape(op, a, ins, outs)
    if op == "Transpose" and len(ins) == 1 and set(a) <= {"perm"}:
        perm, x_id, y_id = a.get("perm"), ins[0], outs[0]
        entry = binder.sized("Transpose", attr.get("layer"), binder.v.residual_ops)

        def transpose(store, ctx):
            y = store[y_id] = store[x_id].transpose(perm)
            return entry(y.size)

        return transpose
    return None


def reshape_by_input_shape(op, a, ins, outs):
    """A free layout op whose operands besides the data are constants: its output shape is a function of the
    input's shape alone, so the generic numpy semantics run once per input shape and later calls are a plain
    C-order reshape to the shape they gave (the same view of the same values)."""
    f, x_id, y_id = GENERIC_FN[op], ins[0], outs[0]
    shapes: dict[tuple, tuple] = {}

    def reshape(store, ctx):
        x = store[x_id]
        out = shapes.get(x.shape)
        if out is None:
            y = f(*[store[i] for i in ins], **a)
            shapes[x.shape] = y.shape
            store[y_id] = y
        else:
            store[y_id] = x.reshape(out)

    return reshape


def hostcall(binder, attr, ins, outs, layer):
    import onnxruntime as ort

    part = binder.program.host[attr["partition"]]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(binder.program.host_models[attr["partition"]], so, providers=["CPUExecutionProvider"])
    entry = binder.sized("hostcall", layer, 1)
    names_in, names_out = part["inputs"], part["outputs"]

    def run(store, ctx):
        h0 = time.perf_counter()
        y = sess.run(names_out, dict(zip(names_in, [store[i] for i in ins])))
        ctx.host_s += time.perf_counter() - h0
        for i, o in zip(outs, y):
            store[i] = o
        return entry(0)

    return run
