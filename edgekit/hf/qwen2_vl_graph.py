"""Qwen2-VL's and Qwen2.5-VL's vision graph at the fixed grid: patchify and the Conv3d as one MatMul, the 2-D
rotary tables and Qwen2.5-VL's window order as constants, the blocks, the merger.

Why apart from `qwen2_vl`: the spec and the family's answers are read by serving, parity and the cost models,
which never build a graph; this module is only what the converter runs. `qwen2_vl`'s docstring says how each
of the processor's and the model's steps becomes a constant here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.export.blocks import layer_norm, linear, rms_norm, silu
from edgekit.export.decoder import apply_rope
from edgekit.export.irbuilder import GraphBuilder, scope_of

from .qwen2_vl import Qwen2VisionSpec, Qwen2VlSpec
from .vision_tower import activation, normalize_frames

F32 = ir.DataType.FLOAT


MLP_ROLES = {False: ("mlp.fc1", "mlp.fc2"), True: ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def vision_names(t: Qwen2VisionSpec, i: int) -> dict[str, str]:
    p = f"{t.prefix}blocks.{i}."
    return {r: p + r for r in ("norm1", "norm2", "attn.qkv", "attn.proj", *MLP_ROLES[t.v25])}


def expected_shapes(spec: Qwen2VlSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the vision graph reads, with the shape config.json implies (module names)."""
    t, p = spec.tower, spec.tower.prefix
    d, m2 = t.hidden, t.hidden * t.merge_size**2
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}patch_embed.proj.weight": (d, t.channels, t.temporal_patch_size, t.patch_size, t.patch_size)
    }
    norms = ("weight",) if t.v25 else ("weight", "bias")  # Qwen2.5-VL: RMSNorm
    for i in range(t.layers):
        n = vision_names(t, i)
        for r in ("norm1", "norm2"):
            shapes.update({f"{n[r]}.{k}": (d,) for k in norms})
        shapes.update({f"{n['attn.qkv']}.weight": (3 * d, d), f"{n['attn.qkv']}.bias": (3 * d,)})
        shapes.update({f"{n['attn.proj']}.weight": (d, d), f"{n['attn.proj']}.bias": (d,)})
        *ups, down = MLP_ROLES[t.v25]
        for r in ups:
            shapes.update({f"{n[r]}.weight": (t.mlp, d), f"{n[r]}.bias": (t.mlp,)})
        shapes.update({f"{n[down]}.weight": (d, t.mlp), f"{n[down]}.bias": (d,)})
    shapes.update({f"{p}merger.ln_q.{k}": (d,) for k in norms})
    shapes.update({f"{p}merger.mlp.0.weight": (m2, m2), f"{p}merger.mlp.0.bias": (m2,)})
    shapes.update({f"{p}merger.mlp.2.weight": (t.out_hidden, m2), f"{p}merger.mlp.2.bias": (t.out_hidden,)})
    return shapes


def patch_positions(t: Qwen2VisionSpec) -> np.ndarray:
    """(patches, 2) row and column of each patch in the processor's merge-window order
    (transformers' `get_vision_position_ids` for grid (1, g, g))."""
    g, m = t.grid, t.merge_size
    hpos, wpos = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
    shape = (g // m, m, g // m, m)
    return np.stack([a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for a in (hpos, wpos)], axis=-1)


def vision_rope_tables(t: Qwen2VisionSpec) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (patches, 1, head_dim): `Qwen2VLVisionRotaryEmbedding` for the fixed grid, in float32."""
    spatial = (t.hidden // t.heads) // 2
    inv_freq = (1.0 / (np.float32(t.rope_theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))).astype(
        np.float32
    )
    freqs = patch_positions(t).astype(np.float32)[..., None] * inv_freq  # (N, 2, hd/4)
    hw = np.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)  # (N, hd/2)
    emb = np.concatenate([hw, hw], axis=-1)[:, None, :]
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def window_index(t: Qwen2VisionSpec) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's `get_vision_window_index` for the fixed grid (1, g, g): the merge units' order (windows of
    `t.window` x `t.window` units, row by row, each window's units row by row) and each unit's window id in that
    order (transformers pads the grid up to whole windows, a whole extra window when it divides; the empty ones
    hold no unit)."""
    g, w = t.grid // t.merge_size, t.window
    index = np.arange(g * g).reshape(g, g)
    pad = w - g % w
    padded = np.pad(index, ((0, pad), (0, pad)), constant_values=-100)
    n = (g + pad) // w
    padded = padded.reshape(n, w, n, w).transpose(0, 2, 1, 3).reshape(n * n, w * w)
    ids = np.repeat(np.arange(n * n), w * w).reshape(n * n, w * w)
    keep = padded != -100
    return padded[keep], ids[keep]


def _rms_or_layer_norm(b: GraphBuilder, x: ir.Value, prefix: str, t: Qwen2VisionSpec) -> ir.Value:
    return rms_norm(b, x, prefix, t.ln_eps) if t.v25 else layer_norm(b, x, prefix, t.ln_eps)


def _patches(b: GraphBuilder, x: ir.Value, t: Qwen2VisionSpec) -> ir.Value:
    """(n, C, S, S) normalised -> (n, patches, C * T * p * p): the processor's `patchify` for a still image
    (merge-window order, the frame repeated `temporal_patch_size` times), then the Conv3d as one MatMul."""
    scope = scope_of(f"{t.prefix}patch_embed")
    c, g, m, p, tt = t.channels, t.grid, t.merge_size, t.patch_size, t.temporal_patch_size
    x = b.op(scope, "Reshape", [x, b.const([-1, c, g // m, m, p, g // m, m, p])])
    x = b.op(scope, "Transpose", [x], {"perm": [0, 2, 5, 3, 6, 1, 4, 7]})  # (n, g/m, g/m, m, m, C, p, p)
    x = b.op(scope, "Reshape", [x, b.const([-1, g * g, c, 1, p * p])])
    if tt > 1:
        x = b.op(scope, "Concat", [x] * tt, {"axis": 3})
    x = b.op(scope, "Reshape", [x, b.const([-1, g * g, c * tt * p * p])])
    name = f"{t.prefix}patch_embed.proj"
    w = b.op(scope, "Reshape", [b.weight(f"{name}.weight"), b.const([t.hidden, c * tt * p * p])])
    return b.op(scope, "MatMul", [x, b.op(scope, "Transpose", [w], {"perm": [1, 0]})])


def _attention(b: GraphBuilder, x: ir.Value, t: Qwen2VisionSpec, i: int, cos, sin, mask=None) -> ir.Value:
    n = vision_names(t, i)
    scope = scope_of(n["attn.qkv"].rsplit(".", 1)[0])
    h, hd = t.heads, t.hidden // t.heads
    qkv = b.op(scope, "Reshape", [linear(b, x, n["attn.qkv"], bias=True), b.const([0, 0, 3, h, hd])])
    parts = b.op_multi(scope, "Split", [qkv], 3, {"axis": 2, "num_outputs": 3})
    q, k, v = (b.op(scope, "Squeeze", [y, b.const([2])]) for y in parts)
    q = apply_rope(b, q, cos, sin, f"{scope}/rotary_q")  # (n, N, h, hd) against (N, 1, hd)
    k = apply_rope(b, k, cos, sin, f"{scope}/rotary_k")
    q = b.op(scope, "Transpose", [q], {"perm": [0, 2, 1, 3]})
    k_t = b.op(scope, "Transpose", [k], {"perm": [0, 2, 3, 1]})
    v = b.op(scope, "Transpose", [v], {"perm": [0, 2, 1, 3]})
    scores = b.op(scope, "Div", [b.op(scope, "MatMul", [q, k_t]), b.const(math.sqrt(hd), np.float32)])
    if mask is not None:  # Qwen2.5-VL's windows: the scores outside a patch's window at float32's lowest
        scores = b.op(scope, "Add", [scores, mask])
    y = b.op(scope, "MatMul", [b.op(scope, "Softmax", [scores], {"axis": -1}), v])
    y = b.op(scope, "Reshape", [b.op(scope, "Transpose", [y], {"perm": [0, 2, 1, 3]}), b.const([0, 0, t.hidden])])
    return linear(b, y, n["attn.proj"], bias=True)


def _mlp(b: GraphBuilder, x: ir.Value, t: Qwen2VisionSpec, n: dict[str, str], scope: str) -> ir.Value:
    if not t.v25:
        y = activation(b, linear(b, x, n["mlp.fc1"], bias=True), scope, t.act)
        return linear(b, y, n["mlp.fc2"], bias=True)
    gate = silu(b, linear(b, x, n["mlp.gate_proj"], bias=True), scope_of(n["mlp.gate_proj"]))
    up = linear(b, x, n["mlp.up_proj"], bias=True)
    return linear(b, b.op(scope, "Mul", [gate, up]), n["mlp.down_proj"], bias=True)


def _window_mask(b: GraphBuilder, t: Qwen2VisionSpec, window_ids: np.ndarray) -> ir.Value:
    """(N, N) additive mask: 0 where two patches (in window order) share a window, float32's lowest elsewhere,
    from one window id per patch (the merge unit's, repeated)."""
    scope = f"{t.prefix}window_attention"
    ids = b.const(np.repeat(window_ids, t.merge_size**2).astype(np.int64))
    same = b.op(
        scope, "Equal", [b.op(scope, "Unsqueeze", [ids, b.const([1])]), b.op(scope, "Unsqueeze", [ids, b.const([0])])]
    )
    return b.op(scope, "Where", [same, b.const(0.0, np.float32), b.const(np.finfo(np.float32).min, np.float32)])


def build_vision(weights: Mapping[str, np.ndarray], spec: Qwen2VlSpec) -> ir.Model:
    """pixel_values (batch, 1, 1, S, S) display values -> image_features (batch, span, text hidden)."""
    t = spec.tower
    b = GraphBuilder(weights, "vision_encoder")
    s, c = t.image_size, t.channels
    pixels = b.input(names.PIXEL_VALUES, F32, ["batch", 1, 1, s, s])
    scope = "/image_processor"
    x = b.op(scope, "Reshape", [pixels, b.const([-1, 1, s, s])])
    x = normalize_frames(b, x, c, spec.image_mean, spec.image_std, scope)
    x = _patches(b, x, t)
    cos_np, sin_np = vision_rope_tables(t)
    units, unit_dim, mask = spec.num_image_tokens, t.hidden * t.merge_size**2, None
    if t.window:  # the window permutation of merge units, on the patches and on the rotary tables
        order, window_ids = window_index(t)
        wscope = f"{t.prefix}window_index"
        x = b.op(wscope, "Reshape", [x, b.const([0, units, unit_dim])])
        x = b.op(wscope, "Gather", [x, b.const(order)], {"axis": 1})
        x = b.op(wscope, "Reshape", [x, b.const([0, t.num_patches, t.hidden])])
        shape = (units, t.merge_size**2, 1, -1)
        cos_np, sin_np = (a.reshape(shape)[order].reshape(t.num_patches, 1, -1) for a in (cos_np, sin_np))
        mask = _window_mask(b, t, window_ids)
    cos, sin = b.const(cos_np, np.float32), b.const(sin_np, np.float32)
    for i in range(t.layers):
        n = vision_names(t, i)
        bscope = scope_of(f"{t.prefix}blocks.{i}")
        windowed = mask if t.window and i not in t.full_attention else None
        h = _rms_or_layer_norm(b, x, n["norm1"], t)
        x = b.op(bscope, "Add", [x, _attention(b, h, t, i, cos, sin, windowed)])
        x = b.op(bscope, "Add", [x, _mlp(b, _rms_or_layer_norm(b, x, n["norm2"], t), t, n, bscope)])
    merger = f"{t.prefix}merger"
    x = _rms_or_layer_norm(b, x, f"{merger}.ln_q", t)
    x = b.op(scope_of(merger), "Reshape", [x, b.const([0, units, unit_dim])])
    x = activation(b, linear(b, x, f"{merger}.mlp.0", bias=True), scope_of(merger), "none")
    x = linear(b, x, f"{merger}.mlp.2", bias=True)
    if t.window:  # back to the image's row order (transformers' argsort of the window index)
        x = b.op(scope_of(merger), "Gather", [x, b.const(np.argsort(order))], {"axis": 1})
    b.output(x, names.IMAGE_FEATURES, F32, ["batch", spec.span_length, spec.decoder.hidden])
    return b.model()
