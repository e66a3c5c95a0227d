"""numpy semantics of the ONNX ops the compiler lowers one-to-one (`compiler.GENERIC`), for the emulator's generic
instructions.

Why a table of numpy calls: these instructions exist so the exported graphs run without host partitions; their
numerics are the ONNX op's own (float32 where the graph is float32), so the reference is numpy doing what ONNX
Runtime does, and the X1-specific integer numerics stay in `kernels`.
"""

from __future__ import annotations

import numpy as np

from .kernels import erf, native, softmax

FREE_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Shape"}  # addresses only (isa.md)


def _reshape(x, shape, allowzero=0):
    shape = [int(s) for s in shape]
    if not allowzero:
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


def _slice(x, starts, ends, axes=None, steps=None):
    axes = list(range(len(starts))) if axes is None else [int(a) % x.ndim for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    idx = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        idx[a] = slice(int(s), int(min(e, np.iinfo(np.int64).max)), int(st))
    return x[tuple(idx)]


_DT = {1: np.float32, 6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64, 2: np.uint8, 3: np.int8}


def _split(x, *rest, axis=0, num_outputs=None):
    if rest and rest[0] is not None:
        return np.split(x, np.cumsum(rest[0])[:-1], axis=axis)
    return np.array_split(x, num_outputs, axis=axis)


def _reduce(fn):
    def run(x, axes=None, keepdims=1, noop_with_empty_axes=0):
        ax = None if axes is None else tuple(int(a) for a in np.asarray(axes).reshape(-1))
        return fn(x, axis=ax, keepdims=bool(keepdims)).astype(x.dtype)

    return run


def layernorm(x, scale, bias=None, axis=-1, epsilon=1e-5, stash_type=1):
    ax = tuple(range(axis % x.ndim, x.ndim))
    n = x.shape[-1] if x.ndim else 0
    # C-contiguous only: numpy reduces a transposed view in another order, which the C rows would not match
    if (
        native.enabled
        and len(ax) == 1
        and x.dtype == np.float32
        and x.flags.c_contiguous
        and all(
            isinstance(o, np.ndarray)
            and o.dtype == np.float32
            and o.size == n
            and o.shape[-1:] == (n,)
            and o.ndim <= x.ndim
            for o in ([scale] if bias is None else [scale, bias])
        )
    ):
        y = np.empty(x.shape, np.float32)  # the same steps per row in C
        native.lib.norm(
            1,
            x,
            np.ascontiguousarray(scale),
            None if bias is None else np.ascontiguousarray(bias),
            float(np.float32(epsilon)),
            y,
        )
        return y
    mean = x.mean(axis=ax, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=ax, keepdims=True)
    ops = [scale] if bias is None else [scale, bias]
    if d.dtype != np.float32 or any(
        np.asarray(o).dtype != np.float32 or np.broadcast_shapes(d.shape, np.shape(o)) != d.shape for o in ops
    ):
        y = d / np.sqrt(var + np.float32(epsilon)) * scale
        return y + bias if bias is not None else y
    # float32 throughout: each step of d / sqrt(var + eps) * scale + bias in place in d (the same operations,
    # without three more full-size temporaries)
    np.divide(d, np.sqrt(var + np.float32(epsilon)), out=d)
    d *= scale
    if bias is not None:
        d += bias
    return d


GENERIC_FN = {
    "Add": lambda a, b: a + b,
    "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b,
    "Div": lambda a, b: (a // b) if a.dtype.kind in "iu" else a / b,
    "Neg": lambda a: -a,
    "Sqrt": np.sqrt,
    "Reciprocal": lambda a: np.float32(1.0) / a,
    "Cos": np.cos,
    "Sin": np.sin,
    "Erf": erf,
    "Tanh": np.tanh,
    "Sigmoid": lambda a: np.float32(1.0) / (np.float32(1.0) + np.exp(-a)),
    "Exp": np.exp,
    "Pow": lambda a, b: np.power(a, b).astype(a.dtype),
    "ReduceMean": _reduce(np.mean),
    "ReduceSum": _reduce(np.sum),
    "ReduceMax": _reduce(np.max),
    "Reshape": lambda x, s, allowzero=0: _reshape(x, s, allowzero),
    "Unsqueeze": lambda x, axes: np.expand_dims(x, tuple(int(a) for a in np.asarray(axes).reshape(-1))),
    "Squeeze": lambda x, axes=None: np.squeeze(
        x, None if axes is None else tuple(int(a) for a in np.asarray(axes).reshape(-1))
    ),
    "Flatten": lambda x, axis=1: x.reshape(int(np.prod(x.shape[:axis])), -1),
    "Identity": lambda x: x,
    "Transpose": lambda x, perm=None: np.transpose(x, perm),
    "Concat": None,
    "Split": _split,
    "Gather": lambda d, i, axis=0: np.take(d, i, axis=axis),
    "Slice": _slice,
    "Expand": lambda x, s: x * np.ones([int(v) for v in s], x.dtype),
    "Shape": lambda x, start=0, end=None: np.array(x.shape[start:end], np.int64),
    "Range": lambda a, b, d: np.arange(a, b, d, dtype=np.asarray(a).dtype),
    "Cast": lambda x, to, saturate=1: x.astype(_DT[to]),
    "ConstantOfShape": lambda s, value=(0.0,): np.full([int(v) for v in s], np.asarray(value).reshape(-1)[0]),
    "LessOrEqual": np.less_equal,
    "Less": np.less,
    "Greater": np.greater,
    "Equal": np.equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Not": np.logical_not,
    "Where": np.where,
    "Softmax": lambda x, axis=-1: (
        softmax(np.moveaxis(x, axis, -1)).swapaxes(-1, axis) if axis not in (-1, x.ndim - 1) else softmax(x)
    ),
    "LayerNormalization": layernorm,
    "MatMul": np.matmul,
}


MULTI_OUT = {"Split"}


BINARY_UFUNC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}  # what GENERIC_FN's a + b, a - b, a * b call
