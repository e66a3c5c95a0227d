"""Attention of the portable decoder, found and replaced by ONNX Runtime's fused CPU attention.

One layer of `edgekit.export.decoder.gqa_attention` is ~25 nodes: q/k/v head splits, two RoPE rotations (Split,
Neg, Concat, Mul, Add), the KV Concat with the past, a grouped MatMul attention with an additive mask, the head
merge. On the cpu target it becomes one `com.microsoft.GroupQueryAttention` (checked against ORT 1.32's CPU
kernel, tests/test_cpu_fast.py):

- KV cache: one buffer per layer, (batch, kv_heads, max_seq, head_dim), bound as both `past_key_values.*` and
  `present.*`; the kernel writes the new keys and values in place at each row's own length and copies nothing
  (ORT's past-present share-buffer mode). `seqlens_k` (batch,) int32 is each row's total length - 1 and
  `total_sequence_length` the batch's longest total. With a shared buffer the kernel takes a prompt with no past
  and seq > 1, a later chunk with past > 0 and seq > 1 (chunked prefill) and decode rows at different lengths in
  one batch, each matching the portable graph. The portable mask (from `attention_mask`) goes: GQA's causal
  window over `seqlens_k` replaces it, and rows are never padded.
- RoPE: `do_rotary` 1, HF's rotate_half layout (`rotary_interleaved` 0), with `cos_cache` / `sin_cache` indexed by
  GQA's `position_ids` input (ORT 1.32's CPU kernel honours it; without it the kernel rotates by each token's
  index in the cache). Two kinds of table:
  - text RoPE (the angles are `position * f`, rope scaling folded into the constant `f`: LLaMA, Qwen2, Mistral,
    radreport-tiny) with a known context: the usual (max_positions, head_dim / 2) constants, indexed by the
    decoder's own `position_ids` (`position_tables`), as onnxruntime-genai's decoders carry them. No node runs
    for them in a step.
  - otherwise each token's own angles, computed by the portable graph's `rope_cos_sin` from `position_ids`, one
    row per token, GQA's `position_ids` 0 .. batch * seq - 1 (`rope_tables`). This covers Qwen2-VL's M-RoPE
    (three position axes per token, which no position-indexed table can express) and has no position limit;
    17 nodes a step. GQA checks the tables against `total_sequence_length`, so they are padded with zero rows
    to it (never read).
- The q, k and v projections are packed into one when they can be (`packing.py`); GQA then takes the packed
  (batch, seq, (heads + 2 kv_heads) * head_dim) query with key and value empty, as onnxruntime-genai's do.

`RotaryEmbedding` (com.microsoft) was the first cut: two nodes per layer, 2-5% of a decode step at batch 1 on
SmolLM2-135M's shape; GQA's own rotation does the same work inside the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from edgekit import names

from .graph_walk import (
    NotPortable,
    arg,
    const,
    const_ints,
    expect,
    first_reader,
    ints,
    made_by,
    named,
    only_user,
    producer,
)

MS_DOMAIN = "com.microsoft"


@dataclass
class Attention:
    """One layer's attention as the portable graph computes it, by the values the fused nodes take over."""

    layer: int
    q: ir.Value  # (batch, seq, heads * head_dim): q_proj's output (its bias added), before the head split
    k: ir.Value
    v: ir.Value
    out: ir.Value  # (batch, seq, heads * head_dim): what o_proj reads
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    freqs: ir.Value  # (batch, seq, head_dim / 2): the RoPE angles of every token, shared by all layers


def _split_heads(bnsh: ir.Value, where: str) -> tuple[ir.Value, int, int]:
    """`Transpose(Reshape(x, [0, 0, n, hd]), [0, 2, 1, 3])` -> (x, n, hd)."""
    t = producer(bnsh, "Transpose", where)
    expect(ints(t, "perm") == [0, 2, 1, 3], f"{where}: {t.name} is not the head split's transpose")
    r = producer(t.inputs[0], "Reshape", where)
    shape = const_ints(r.inputs[1], where)
    expect(len(shape) == 4 and shape[:2] == [0, 0] and min(shape[2:]) > 0, f"{where}: {r.name} shape {shape}")
    return arg(r, 0, where), shape[2], shape[3]


def _rope_freqs(table: ir.Value, fn: str, where: str) -> ir.Value:
    """`Unsqueeze(Cos|Sin(Concat(f, f)), [1])` -> f, the angles (batch, seq, head_dim / 2)."""
    u = producer(table, "Unsqueeze", where)
    c = producer(producer(u.inputs[0], fn, where).inputs[0], "Concat", where)
    expect(len(c.inputs) == 2 and c.inputs[0] is c.inputs[1], f"{where}: {c.name} is not concat(freqs, freqs)")
    return arg(c, 0, where)


def _unrope(rotated: ir.Value, where: str) -> tuple[ir.Value, ir.Value]:
    """`x * cos + concat(-x2, x1) * sin` (HF's rotate_half) -> (x, the angles)."""
    add = producer(rotated, "Add", where)
    muls = [producer(v, "Mul", where) for v in add.inputs]
    for straight, turned in (muls, muls[::-1]):
        x, cos = arg(straight, 0, where), arg(straight, 1, where)
        half, sin = arg(turned, 0, where), arg(turned, 1, where)
        cat = half.producer()
        if cat is None or cat.op_type != "Concat":
            continue
        split = producer(cat.inputs[1], "Split", where)
        neg = producer(cat.inputs[0], "Neg", where)
        expect(split.inputs[0] is x, f"{where}: {split.name} does not split the rotated input")
        expect(neg.inputs[0] is split.outputs[1] and cat.inputs[1] is split.outputs[0], f"{where}: not rotate_half")
        freqs = _rope_freqs(cos, "Cos", where)
        expect(_rope_freqs(sin, "Sin", where) is freqs, f"{where}: cos and sin from different angles")
        return x, freqs
    raise NotPortable(f"{where}: {add.name} is not a RoPE rotation")


def _kv_concat(graph: ir.Graph, output: str, past: str, where: str) -> tuple[ir.Node, ir.Value]:
    value = next((v for v in graph.outputs if v.name == output), None)
    expect(value is not None, f"the decoder has no output {output}")
    cat = producer(value, "Concat", where)
    expect(cat.attributes.get("axis") is not None and cat.attributes["axis"].as_int() in (2, -2), f"{where}: axis")
    expect(len(cat.inputs) == 2 and arg(cat, 0, where).name == past, f"{where}: {cat.name} does not append to {past}")
    return cat, arg(cat, 1, where)


def find_attention(graph: ir.Graph, layer: int) -> Attention:
    """Layer `layer`'s attention, found from its `present.{layer}.*` outputs; `NotPortable` if it differs."""
    where = f"layer {layer} attention"
    key_cat, k_rot = _kv_concat(graph, names.present_key(layer), names.past_key(layer), where)
    value_cat, v_heads = _kv_concat(graph, names.present_value(layer), names.past_value(layer), where)
    k_heads, freqs = _unrope(k_rot, where)
    k, kv_heads, head_dim = _split_heads(k_heads, where)
    v, kv_v, hd_v = _split_heads(v_heads, where)
    expect((kv_v, hd_v) == (kv_heads, head_dim), f"{where}: k and v heads differ")

    # scores: Div(MatMul(Reshape(q_rot, [0, kv, group, -1, hd]), Unsqueeze(Transpose(present_key))), sqrt(hd))
    k_t = only_user(key_cat.outputs[0], "Transpose", where)
    expect(ints(k_t, "perm") == [0, 1, 3, 2], f"{where}: {k_t.name} perm")
    scores = only_user(only_user(k_t.outputs[0], "Unsqueeze", where).outputs[0], "MatMul", where)
    grouped = producer(scores.inputs[0], "Reshape", where)
    q_heads, q_freqs = _unrope(arg(grouped, 0, where), where)
    expect(q_freqs is freqs, f"{where}: q and k rotated by different angles")
    q, heads, q_hd = _split_heads(q_heads, where)
    expect(q_hd == head_dim and heads % kv_heads == 0, f"{where}: {heads} query heads over {kv_heads} KV heads")
    div = only_user(scores.outputs[0], "Div", where)
    divisor = const(div.inputs[1])
    if divisor is None or np.size(divisor) != 1:
        raise NotPortable(f"{where}: {div.name} divides by a computed value")

    # output: Reshape(Transpose(Reshape(MatMul(probs, Unsqueeze(present_value))))) -> (b, s, heads * hd)
    pv = only_user(only_user(value_cat.outputs[0], "Unsqueeze", where).outputs[0], "MatMul", where)
    merge = only_user(
        only_user(only_user(pv.outputs[0], "Reshape", where).outputs[0], "Transpose", where).outputs[0],
        "Reshape",
        where,
    )
    expect(const_ints(merge.inputs[1], where)[-1] in (heads * head_dim, -1), f"{where}: {merge.name} merges heads")
    return Attention(layer, q, k, v, merge.outputs[0], heads, kv_heads, head_dim, float(1.0 / divisor.item()), freqs)


@dataclass
class Rope:
    """The per-token RoPE tables every layer's GroupQueryAttention reads."""

    positions: ir.Value  # (batch, seq) int64: each token's row of the tables
    cos: ir.Value  # (rows, head_dim / 2)
    sin: ir.Value


def rope_tables(graph: ir.Graph, freqs: ir.Value, embeds: ir.Value, total: ir.Value, head_dim: int) -> Rope:
    """cos / sin of every token's angles, one row per token, inserted after the angles are made.

    GroupQueryAttention refuses tables shorter than `total_sequence_length` (it checks the rows against the
    longest position it could be asked for), so the tables are padded with zero rows up to it; the padding is
    never read (`positions` stays below batch * seq)."""
    nodes: list[ir.Node] = []

    def op(op_type: str, inputs, attrs=None) -> ir.Value:
        node = named(ir.node(op_type, inputs, attrs, name=f"/model/rotary_emb/cpu/{op_type}_{len(nodes)}"))
        nodes.append(node)
        return node.outputs[0]

    def c(array) -> ir.Value:
        return op("Constant", [], {"value": ir.tensor(np.asarray(array, np.int64))})

    batch_seq = op("Shape", [embeds], {"start": 0, "end": 2})
    count = op("ReduceProd", [batch_seq], {"keepdims": 0})
    positions = op("Reshape", [op("Range", [c(0), count, c(1)]), batch_seq])
    missing = op("Max", [op("Sub", [op("Cast", [total], {"to": ir.DataType.INT64}), count]), c(0)])
    pads = op("Concat", [c([0, 0]), op("Reshape", [missing, c([1])]), c([0])], {"axis": 0})
    flat = c([-1, head_dim // 2])
    cos = op("Pad", [op("Reshape", [op("Cos", [freqs]), flat]), pads])
    sin = op("Pad", [op("Reshape", [op("Sin", [freqs]), flat]), pads])
    graph.insert_after(made_by(freqs, "rope tables"), nodes)
    return Rope(positions, cos, sin)


def text_angles(freqs: ir.Value, position_ids: ir.Value) -> np.ndarray | None:
    """The frequencies `f` when the angles are `position * f` of the text positions (the portable export's
    `Mul(Unsqueeze(Cast(position_ids), [-1]), f)`, whatever rope scaling folded into `f`); None for anything
    else (M-RoPE's per-axis sections, an angle computed some other way)."""
    mul = freqs.producer()
    if mul is None or mul.op_type != "Mul" or len(mul.inputs) != 2:
        return None
    for pos, f in (mul.inputs, mul.inputs[::-1]):
        inv = const(f)
        unsq = pos.producer() if pos is not None else None
        if inv is None or inv.ndim != 1 or unsq is None or unsq.op_type != "Unsqueeze":
            continue
        cast = unsq.inputs[0].producer() if unsq.inputs[0] is not None else None
        axes = const(unsq.inputs[1]) if len(unsq.inputs) > 1 else None  # opset < 13: axes an attribute
        if cast is not None and cast.op_type == "Cast" and cast.inputs[0] is position_ids:
            if axes is not None and axes.tolist() in ([-1], [2]):
                return inv.astype(np.float32)
    return None


def position_tables(graph: ir.Graph, inv_freq: np.ndarray, position_ids: ir.Value, rows: int) -> Rope:
    """cos / sin of positions 0 .. rows - 1 as constants, indexed by the decoder's own `position_ids`: what
    onnxruntime-genai's decoders carry. The per-token tables (`rope_tables`) cost 17 nodes a step, ~10% of
    radreport-tiny's 0.12 ms decode step (ORT's C API, bench/decode_split.py); these cost none. The angles are
    the portable graph's own float32 product `position * f`, so a token is rotated as before."""
    angles = np.arange(rows, dtype=np.float32)[:, None] * inv_freq[None, :]
    tables = []
    for fn in ("cos", "sin"):
        tensor = ir.tensor(getattr(np, fn)(angles).astype(np.float32), name=f"/model/rotary_emb/cpu/{fn}_cache")
        value = ir.val(tensor.name, ir.DataType.FLOAT, list(angles.shape), const_value=tensor)
        graph.register_initializer(value)
        tables.append(value)
    return Rope(position_ids, tables[0], tables[1])


def fuse_attention(
    graph: ir.Graph, a: Attention, rope: Rope, seqlens_k: ir.Value, total: ir.Value, qkv: ir.Value | None = None
) -> None:
    """Replace layer `a.layer`'s attention by one GroupQueryAttention that rotates q and k by `rope` and writes
    its KV in place. `qkv`: q, k and v packed along the last axis (`packing.py`), else they go in apart."""
    scope = f"/model/layers.{a.layer}/self_attn/cpu"
    past = {v.name: v for v in graph.inputs}
    gqa = named(
        ir.node(
            "GroupQueryAttention",
            [
                *([qkv, None, None] if qkv is not None else [a.q, a.k, a.v]),
                past[names.past_key(a.layer)],
                past[names.past_value(a.layer)],
                seqlens_k,
                total,
                rope.cos,
                rope.sin,
                rope.positions,
            ],
            {
                "num_heads": a.heads,
                "kv_num_heads": a.kv_heads,
                "scale": a.scale,
                "do_rotary": 1,
                "rotary_interleaved": 0,
            },
            domain=MS_DOMAIN,
            num_outputs=3,
            name=f"{scope}/GroupQueryAttention",
        )
    )
    graph.insert_before(first_reader(graph, [a.out]), gqa)
    a.out.replace_all_uses_with(gqa.outputs[0])
    for i, name in ((1, names.present_key(a.layer)), (2, names.present_value(a.layer))):
        index = next(j for j, v in enumerate(graph.outputs) if v.name == name)
        old, new = graph.outputs[index], gqa.outputs[i]
        old.name = f"{name}_portable"
        new.name, new.shape = name, old.shape
        if old.dtype is not None:
            new.dtype = old.dtype
        graph.outputs[index] = new


def attention_layers(graph: ir.Graph) -> int:
    """How many layers carry a KV cache (`present.{i}.key` outputs)."""
    return sum(
        1 for v in graph.outputs if (v.name or "").startswith(names.PRESENT_PREFIX) and (v.name or "").endswith(".key")
    )
