"""`vision_encoder.onnx`: frames -> image tokens for the decoder.

A ViT/SigLIP-style encoder runs on every frame (batch * frames images), then radreport-tiny's head: mean and
standard deviation across frames (so cine motion survives pooling), average pooling of the patch grid, and the
two-layer connector into the decoder's width. Follows `RadReportTiny.encode_images` op for op.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from edgekit import names

from .blocks import gelu, layer_norm, linear
from .irbuilder import GraphBuilder, scope_of
from .specs import VisionSpec

F32 = ir.DataType.FLOAT


def patch_embeddings(b: GraphBuilder, images: ir.Value, spec: VisionSpec) -> ir.Value:
    """(N, C, H, W) -> (N, grid*grid, hidden): a strided Conv, row-major patches, plus learned positions."""
    prefix = f"{spec.prefix}.embeddings"
    scope = scope_of(f"{prefix}.patch_embedding")
    p = spec.patch_size
    y = b.op(
        scope,
        "Conv",
        [images, b.weight(f"{prefix}.patch_embedding.weight"), b.weight(f"{prefix}.patch_embedding.bias")],
        {"kernel_shape": [p, p], "strides": [p, p]},
    )
    y = b.op(scope, "Reshape", [y, b.const([0, spec.hidden, -1])])
    y = b.op(scope, "Transpose", [y], {"perm": [0, 2, 1]})
    return b.op(scope_of(prefix), "Add", [y, b.weight(f"{prefix}.position_embedding.weight")])


def vision_attention(b: GraphBuilder, x: ir.Value, prefix: str, spec: VisionSpec) -> ir.Value:
    """Bidirectional multi-head self-attention over the patches of one image."""
    scope = scope_of(prefix)
    h, hd = spec.heads, spec.head_dim

    def heads(proj: str, perm: list[int]) -> ir.Value:
        y = linear(b, x, f"{prefix}.{proj}", bias=True)
        return b.op(scope, "Transpose", [b.op(scope, "Reshape", [y, b.const([0, 0, h, hd])])], {"perm": perm})

    q = heads("q_proj", [0, 2, 1, 3])  # (N, h, P, hd)
    k_t = heads("k_proj", [0, 2, 3, 1])  # (N, h, hd, P)
    v = heads("v_proj", [0, 2, 1, 3])
    scores = b.op(scope, "Div", [b.op(scope, "MatMul", [q, k_t]), b.const(math.sqrt(hd), np.float32)])
    y = b.op(scope, "MatMul", [b.op(scope, "Softmax", [scores], {"axis": -1}), v])
    y = b.op(scope, "Reshape", [b.op(scope, "Transpose", [y], {"perm": [0, 2, 1, 3]}), b.const([0, 0, spec.hidden])])
    return linear(b, y, f"{prefix}.out_proj", bias=True)


def vision_mlp(b: GraphBuilder, x: ir.Value, prefix: str, spec: VisionSpec) -> ir.Value:
    y = gelu(b, linear(b, x, f"{prefix}.fc1", bias=True), scope_of(prefix), approximate=spec.gelu)
    return linear(b, y, f"{prefix}.fc2", bias=True)


def vision_layer(b: GraphBuilder, x: ir.Value, prefix: str, spec: VisionSpec) -> ir.Value:
    """Pre-norm transformer layer (SigLIP naming: layer_norm1, self_attn, layer_norm2, mlp)."""
    scope = scope_of(prefix)
    x = b.op(
        scope,
        "Add",
        [x, vision_attention(b, layer_norm(b, x, f"{prefix}.layer_norm1", spec.ln_eps), f"{prefix}.self_attn", spec)],
    )
    return b.op(
        scope, "Add", [x, vision_mlp(b, layer_norm(b, x, f"{prefix}.layer_norm2", spec.ln_eps), f"{prefix}.mlp", spec)]
    )


def temporal_mean_std_pool(b: GraphBuilder, x: ir.Value, pixel_values: ir.Value, spec: VisionSpec) -> ir.Value:
    """(batch*frames, P, D) -> (batch, P, 2D): per-patch mean and sqrt(var + eps) across frames."""
    scope = "/temporal_pool"
    batch_frames = b.op(scope, "Shape", [pixel_values], {"start": 0, "end": 2})
    shape = b.op(scope, "Concat", [batch_frames, b.const([spec.grid * spec.grid, spec.hidden])], {"axis": 0})
    x = b.op(scope, "Reshape", [x, shape])  # (b, t, P, D)
    axis = b.const([1])
    mean = b.op(scope, "ReduceMean", [x, axis], {"keepdims": 1})
    diff = b.op(scope, "Sub", [x, mean])
    var = b.op(scope, "ReduceMean", [b.op(scope, "Mul", [diff, diff]), axis], {"keepdims": 0})
    std = b.op(scope, "Sqrt", [b.op(scope, "Add", [var, b.const(spec.temporal_std_eps, np.float32)])])
    mean = b.op(scope, "Squeeze", [mean, axis])
    return b.op(scope, "Concat", [mean, std], {"axis": -1})


def spatial_pool(b: GraphBuilder, x: ir.Value, spec: VisionSpec) -> ir.Value:
    """(batch, grid*grid, C) -> (batch, (grid/s)^2, C): average over s x s blocks of the patch grid."""
    scope = "/spatial_pool"
    g, s, c = spec.grid, spec.pool_stride, 2 * spec.hidden
    x = b.op(scope, "Reshape", [x, b.const([-1, g // s, s, g // s, s, c])])
    x = b.op(scope, "ReduceMean", [x, b.const([2, 4])], {"keepdims": 0})
    return b.op(scope, "Reshape", [x, b.const([-1, (g // s) ** 2, c])])


def connector(b: GraphBuilder, x: ir.Value, spec: VisionSpec) -> ir.Value:
    y = gelu(b, linear(b, x, f"{spec.connector}.fc1", bias=True), scope_of(spec.connector))
    return linear(b, y, f"{spec.connector}.fc2", bias=True)


def build_vision_encoder(weights: Mapping[str, np.ndarray], spec: VisionSpec) -> ir.Model:
    b = GraphBuilder(weights, "vision_encoder")
    pixel_values = b.input(
        names.PIXEL_VALUES, F32, ["batch", "frames", spec.channels, spec.image_size, spec.image_size]
    )
    images = b.op(
        scope_of(spec.prefix), "Reshape", [pixel_values, b.const([-1, spec.channels, spec.image_size, spec.image_size])]
    )
    x = patch_embeddings(b, images, spec)
    for i in range(spec.layers):
        x = vision_layer(b, x, f"{spec.prefix}.encoder.layers.{i}", spec)
    x = layer_norm(b, x, f"{spec.prefix}.post_layernorm", spec.ln_eps)
    x = spatial_pool(b, temporal_mean_std_pool(b, x, pixel_values, spec), spec)
    b.output(connector(b, x, spec), names.IMAGE_FEATURES, F32, ["batch", spec.num_image_tokens, spec.out_hidden])
    return b.model()
