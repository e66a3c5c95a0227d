"""Building blocks shared by the vision and decoder graphs: linear layers, norms and activations.

Each takes the weight prefix (a Hugging Face module name) and names its nodes after it. RMSNorm and GELU are
decomposed into basic ops (no opset-23 RMSNormalization, no opset-20 Gelu) so every consumer — ORT, TensorRT,
the x1 compiler — sees the same small op vocabulary; LayerNorm uses `LayerNormalization` (opset 17), which all do.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from .irbuilder import GraphBuilder, scope_of


def linear(b: GraphBuilder, x: ir.Value, prefix: str, *, bias: bool) -> ir.Value:
    """`nn.Linear`: the weight stays in its (out, in) layout and feeds `Transpose -> MatMul`, so weight-rewriting
    passes (LoRA merge, blockwise INT4 along `in`) see the checkpoint tensor unchanged; ORT folds the Transpose."""
    scope = scope_of(prefix)
    w_t = b.op(scope, "Transpose", [b.weight(f"{prefix}.weight")], {"perm": [1, 0]})
    y = b.op(scope, "MatMul", [x, w_t])
    if bias:
        y = b.op(scope, "Add", [y, b.weight(f"{prefix}.bias")])
    return y


def layer_norm(b: GraphBuilder, x: ir.Value, prefix: str, eps: float) -> ir.Value:
    return b.op(
        scope_of(prefix),
        "LayerNormalization",
        [x, b.weight(f"{prefix}.weight"), b.weight(f"{prefix}.bias")],
        {"axis": -1, "epsilon": float(eps)},
    )


def rms_norm(b: GraphBuilder, x: ir.Value, prefix: str, eps: float) -> ir.Value:
    """x * rsqrt(mean(x^2) + eps) * weight, in the reference's order of operations."""
    scope = scope_of(prefix)
    sq = b.op(scope, "Mul", [x, x])
    mean = b.op(scope, "ReduceMean", [sq, b.const([-1])], {"keepdims": 1})
    std = b.op(scope, "Sqrt", [b.op(scope, "Add", [mean, b.const(eps, np.float32)])])
    normed = b.op(scope, "Mul", [x, b.op(scope, "Reciprocal", [std])])
    return b.op(scope, "Mul", [normed, b.weight(f"{prefix}.weight")])


def gelu(b: GraphBuilder, x: ir.Value, scope: str, *, approximate: str = "none") -> ir.Value:
    """GELU as PyTorch computes it: exact (erf) by default, or the tanh approximation (SigLIP's gelu_pytorch_tanh)."""
    scope = f"{scope}/Gelu"
    f32 = np.float32
    if approximate == "tanh":
        cube = b.op(scope, "Mul", [b.op(scope, "Mul", [x, x]), x])
        inner = b.op(scope, "Add", [x, b.op(scope, "Mul", [cube, b.const(0.044715, f32)])])
        t = b.op(scope, "Tanh", [b.op(scope, "Mul", [inner, b.const(math.sqrt(2.0 / math.pi), f32)])])
    elif approximate == "none":
        t = b.op(scope, "Erf", [b.op(scope, "Mul", [x, b.const(1.0 / math.sqrt(2.0), f32)])])
    else:
        raise ValueError(f"unknown GELU approximation {approximate!r}")
    half_x = b.op(scope, "Mul", [x, b.const(0.5, f32)])
    return b.op(scope, "Mul", [half_x, b.op(scope, "Add", [t, b.const(1.0, f32)])])


def silu(b: GraphBuilder, x: ir.Value, scope: str) -> ir.Value:
    scope = f"{scope}/Silu"
    return b.op(scope, "Mul", [x, b.op(scope, "Sigmoid", [x])])
