"""`decoder_model_merged.onnx`: one graph for prefill and decode (past length 0 for prefill), KV cache in and out.

Follows `RadReportTiny.decode` op for op. No `If`/`Loop` and no com.microsoft ops (GroupQueryAttention,
RotaryEmbedding...): GQA is a broadcast MatMul over (kv_heads, group) and the mask is built from
`attention_mask` and the past length with Range/LessOrEqual, so TensorRT and the x1 compiler can take it as is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from edgekit import names

from .blocks import linear, rms_norm, silu
from .irbuilder import GraphBuilder, scope_of
from .specs import DecoderSpec

F32, I64 = ir.DataType.FLOAT, ir.DataType.INT64


def rope_cos_sin(b: GraphBuilder, position_ids: ir.Value, spec: DecoderSpec) -> tuple[ir.Value, ir.Value]:
    """cos/sin (batch, 1, seq, head_dim) from position ids; HF LLaMA layout (frequencies repeated, not interleaved).

    M-RoPE (`spec.mrope_section`): position_ids is (3, batch, seq) and frequency section i rotates by axis i % 3's
    positions (transformers' `Qwen2VLRotaryEmbedding`: each frequency times its axis' position, then cos/sin;
    picking the axis before the product is the same numbers). The rotation itself is the same ops, so a
    consumer that matches RoPE on `x * cos + rotate_half(x) * sin` (the x1 compiler) sees it unchanged."""
    scope = "/model/rotary_emb"
    if spec.rope_inv_freq is not None:
        inv_freq = np.asarray(spec.rope_inv_freq, np.float32)
    else:
        exponents = np.arange(0, spec.head_dim, 2, dtype=np.float32) / np.float32(spec.head_dim)
        inv_freq = (1.0 / (float(spec.rope_theta) ** exponents.astype(np.float64))).astype(np.float32)
    pos = b.op(scope, "Unsqueeze", [b.op(scope, "Cast", [position_ids], {"to": F32}), b.const([-1])])
    if spec.mrope_section is None:
        freqs = b.op(scope, "Mul", [pos, b.const(inv_freq, np.float32)])  # (b, s, hd/2)
    else:  # (3, b, s, 1): each section's frequencies times its own axis' positions, concatenated
        parts, lo = [], 0
        for i, n in enumerate(spec.mrope_section):
            axis = b.op(scope, "Slice", [pos, b.const([i % 3]), b.const([i % 3 + 1]), b.const([0])])
            axis = b.op(scope, "Squeeze", [axis, b.const([0])])  # (b, s, 1)
            parts.append(b.op(scope, "Mul", [axis, b.const(inv_freq[lo : lo + n], np.float32)]))
            lo += n
        freqs = b.op(scope, "Concat", parts, {"axis": -1})  # (b, s, hd/2)
    emb = b.op(scope, "Concat", [freqs, freqs], {"axis": -1})
    cos = b.op(scope, "Unsqueeze", [b.op(scope, "Cos", [emb]), b.const([1])])
    sin = b.op(scope, "Unsqueeze", [b.op(scope, "Sin", [emb]), b.const([1])])
    return cos, sin


def apply_rope(b: GraphBuilder, x: ir.Value, cos: ir.Value, sin: ir.Value, scope: str) -> ir.Value:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = concat(-x2, x1)."""
    x1, x2 = b.op_multi(scope, "Split", [x], 2, {"axis": -1, "num_outputs": 2})
    rotated = b.op(scope, "Concat", [b.op(scope, "Neg", [x2]), x1], {"axis": -1})
    return b.op(scope, "Add", [b.op(scope, "Mul", [x, cos]), b.op(scope, "Mul", [rotated, sin])])


def causal_padding_mask(b: GraphBuilder, inputs_embeds: ir.Value, attention_mask: ir.Value) -> ir.Value:
    """Additive mask (batch, 1, 1, seq, past+seq): query at absolute position p sees keys <= p that
    `attention_mask` keeps; the past length is `attention_mask` length minus `seq`. Extra axis for the GQA group."""
    scope = "/model/attn_mask"
    scalar = lambda v: b.op(scope, "Squeeze", [v, b.const([0])])  # noqa: E731
    seq = scalar(b.op(scope, "Shape", [inputs_embeds], {"start": 1, "end": 2}))
    total = scalar(b.op(scope, "Shape", [attention_mask], {"start": 1, "end": 2}))
    past = b.op(scope, "Sub", [total, seq])
    zero, one = b.const(0), b.const(1)
    q_pos = b.op(scope, "Add", [b.op(scope, "Range", [zero, seq, one]), past])
    k_pos = b.op(scope, "Range", [zero, total, one])
    causal = b.op(scope, "LessOrEqual", [k_pos, b.op(scope, "Unsqueeze", [q_pos, b.const([1])])])  # (s, T)
    keep = b.op(scope, "Cast", [attention_mask], {"to": ir.DataType.BOOL})
    keep = b.op(scope, "Unsqueeze", [keep, b.const([1, 2, 3])])  # (b, 1, 1, 1, T)
    allowed = b.op(scope, "And", [causal, keep])
    neg = b.const(np.finfo(np.float32).min, np.float32)
    return b.op(scope, "Where", [allowed, b.const(0.0, np.float32), neg])


def gqa_attention(b, x, cos, sin, mask, past_key, past_value, prefix: str, spec: DecoderSpec):
    """Grouped-query self-attention with the KV cache concatenated along the sequence axis.

    Query heads are viewed as (kv_heads, group) so each group broadcasts against its one KV head — the same
    math as the reference's `repeat_interleave`, without copying K/V. Returns (output, present_key, present_value).
    """
    scope = scope_of(prefix)
    hd, kv, group = spec.head_dim, spec.kv_heads, spec.heads // spec.kv_heads

    def heads(proj: str, n: int) -> ir.Value:  # (b, s, n*hd) -> (b, n, s, hd)
        y = linear(b, x, f"{prefix}.{proj}", bias=spec.qkv_bias)
        y = b.op(scope, "Reshape", [y, b.const([0, 0, n, hd])])
        return b.op(scope, "Transpose", [y], {"perm": [0, 2, 1, 3]})

    q = apply_rope(b, heads("q_proj", spec.heads), cos, sin, f"{scope}/rotary_q")
    k = apply_rope(b, heads("k_proj", kv), cos, sin, f"{scope}/rotary_k")
    v = heads("v_proj", kv)
    present_key = b.op(scope, "Concat", [past_key, k], {"axis": 2})
    present_value = b.op(scope, "Concat", [past_value, v], {"axis": 2})

    q = b.op(scope, "Reshape", [q, b.const([0, kv, group, -1, hd])])  # (b, kv, group, s, hd)
    k_t = b.op(scope, "Transpose", [present_key], {"perm": [0, 1, 3, 2]})
    k_t = b.op(scope, "Unsqueeze", [k_t, b.const([2])])  # (b, kv, 1, hd, T)
    scores = b.op(scope, "Div", [b.op(scope, "MatMul", [q, k_t]), b.const(math.sqrt(hd), np.float32)])
    probs = b.op(scope, "Softmax", [b.op(scope, "Add", [scores, mask])], {"axis": -1})
    v_g = b.op(scope, "Unsqueeze", [present_value, b.const([2])])  # (b, kv, 1, T, hd)
    y = b.op(scope, "MatMul", [probs, v_g])  # (b, kv, group, s, hd)
    y = b.op(scope, "Reshape", [y, b.const([0, spec.heads, -1, hd])])
    y = b.op(scope, "Transpose", [y], {"perm": [0, 2, 1, 3]})
    y = b.op(scope, "Reshape", [y, b.const([0, 0, spec.heads * hd])])
    return linear(b, y, f"{prefix}.o_proj", bias=False), present_key, present_value


def swiglu_mlp(b: GraphBuilder, x: ir.Value, prefix: str) -> ir.Value:
    gate = silu(b, linear(b, x, f"{prefix}.gate_proj", bias=False), scope_of(f"{prefix}.gate_proj"))
    up = linear(b, x, f"{prefix}.up_proj", bias=False)
    return linear(b, b.op(scope_of(prefix), "Mul", [gate, up]), f"{prefix}.down_proj", bias=False)


def decoder_layer(b, x, cos, sin, mask, past_key, past_value, prefix: str, spec: DecoderSpec):
    scope = scope_of(prefix)
    h = rms_norm(b, x, f"{prefix}.input_layernorm", spec.rms_eps)
    a, present_key, present_value = gqa_attention(
        b, h, cos, sin, mask, past_key, past_value, f"{prefix}.self_attn", spec
    )
    x = b.op(scope, "Add", [x, a])
    h = rms_norm(b, x, f"{prefix}.post_attention_layernorm", spec.rms_eps)
    return b.op(scope, "Add", [x, swiglu_mlp(b, h, f"{prefix}.mlp")]), present_key, present_value


def build_decoder(weights: Mapping[str, np.ndarray], spec: DecoderSpec) -> ir.Model:
    """The merged decoder graph with the input/output names of Hugging Face VLM exports."""
    b = GraphBuilder(weights, "decoder_model_merged")
    kv_shape: list[int | str] = ["batch", spec.kv_heads, "past_seq", spec.head_dim]
    x = b.input(names.INPUTS_EMBEDS, F32, ["batch", "seq", spec.hidden])
    attention_mask = b.input(names.ATTENTION_MASK, I64, ["batch", "total_seq"])
    position_shape: list[int | str] = ["batch", "seq"] if spec.mrope_section is None else [3, "batch", "seq"]
    position_ids = b.input(names.POSITION_IDS, I64, position_shape)
    past = [
        (b.input(names.past_key(i), F32, kv_shape), b.input(names.past_value(i), F32, kv_shape))
        for i in range(spec.layers)
    ]
    cos, sin = rope_cos_sin(b, position_ids, spec)
    mask = causal_padding_mask(b, x, attention_mask)
    presents = []
    for i in range(spec.layers):
        x, pk, pv = decoder_layer(b, x, cos, sin, mask, *past[i], f"{spec.layer_prefix}.{i}", spec)
        presents.append((pk, pv))
    x = rms_norm(b, x, spec.final_norm, spec.rms_eps)
    logits = linear(b, x, spec.lm_head, bias=False)
    b.output(logits, names.LOGITS, F32, ["batch", "seq", spec.vocab_size])
    present_shape: list[int | str] = ["batch", spec.kv_heads, "total_seq", spec.head_dim]
    for i, (pk, pv) in enumerate(presents):
        b.output(pk, names.present_key(i), F32, present_shape)
        b.output(pv, names.present_value(i), F32, present_shape)
    return b.model()
