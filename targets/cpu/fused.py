"""The cpu target's own decoder: the portable graph lowered onto ONNX Runtime's fused CPU kernels.

Why a second decoder: `decoder_model_merged.onnx` is written for every consumer (TensorRT, the x1 compiler), so
it has no contrib ops and carries its KV cache as a growing Concat: each decode step copies every layer's whole
cache into a new `present` tensor. onnxruntime-genai's decoders avoid both. This lowering takes the portable graph
after the recipe's passes (INT4 `MatMulNBits`, LoRA merges, pruned heads, FP16 casts: projections are left as
the passes wrote them) and rewrites, for the cpu target only:

- attention into one `GroupQueryAttention` per layer that rotates q and k itself (RoPE tables indexed by
  position where the angles are text positions times constant frequencies and the model's context is known,
  else per-token tables, so M-RoPE too) over one preallocated KV buffer per layer that is both past and present
  (`attention.py`), with
  q/k/v packed into one projection where the passes left them packable (`packing.py`); the `attention_mask`
  input and its mask subgraph go;
- RMSNorms, with the residual Add in front, into `SkipSimplifiedLayerNormalization` (`norms.py`);
- the LM head onto the last position only: the engine needs the next token's logits, and a 32-token prompt
  through a 49k-vocabulary head is 32x the work of the one row it keeps;
- every `MatMulNBits` to `accuracy_level` (see `ACCURACY_LEVEL`);
- each row's greedy token as an output of its own (`GREEDY_TOKEN`, ArgMax over the logits, first index on a tie
  as numpy's argmax): a greedy step reads one int per row from the bound output instead of an argmax in numpy,
  which right after a run, caches cold from the graph, cost 6 us of radreport-tiny's 0.15 ms token.

Signature (`FusedSignature` says it in code): inputs `inputs_embeds` (batch, seq, hidden), `position_ids` as the
portable graph takes them ((batch, seq), or (3, batch, seq) for M-RoPE), `seqlens_k` (batch,) int32 = each row's
total length - 1, `total_sequence_length` () int32 = the longest total, `past_key_values.{i}.key|value` (batch,
kv_heads, max_seq, head_dim); outputs `logits` (batch, 1, vocab), `greedy_token` (batch, 1) int64 (decoders
lowered before it have none) and `present.{i}.key|value`, the same shape as
the past and meant to be bound to the same buffers (`slots.CpuSlotBackend`). One restriction, from ORT's kernel:
a first prompt of several rows (seq > 1 and no past: seq == total_sequence_length) is exact only when every row
has the same positions, because GQA then reads only the first element of its `position_ids` and rotates every row
from there (measured on ORT 1.32; the schema says so too). Later chunks (past > 0) and decode steps take any rows.
`CpuSlotBackend.prefill_rows` takes such first prompts together (the same length and positions: bit-identical to
one row at a time on radreport-tiny), and any other prompt one row per call. With position-indexed tables the
model's metadata `edgekit.rope_positions` (`ROPE_POSITIONS`) says how many rows they hold: no row may grow past it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from edgekit import names

from .attention import (
    MS_DOMAIN,
    attention_layers,
    find_attention,
    fuse_attention,
    position_tables,
    rope_tables,
    text_angles,
)
from .graph_walk import NotPortable, expect, made_by, named
from .norms import find_rms_norms, fuse_norm, leave_unread_outputs_out
from .packing import float_projections, pack_projections

FUSED_DECODER = "decoder_cpu.onnx"  # the bundle file
FUSED_ROLE = "cpu_decoder"  # its bundle role (and `cpu_decoder_data` for external weights)
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
GREEDY_TOKEN = "greedy_token"  # output: each row's argmax over the vocabulary (batch, 1) int64
MAX_SEQ = "max_seq"
ROPE_POSITIONS = "edgekit.rope_positions"  # metadata: rows of the position-indexed RoPE tables (absent: per token)

# MatMulNBits' accuracy_level on this target: 4 quantizes each activation block to int8 and runs MLAS' integer
# kernels; 0 dequantizes the weights to float32. Measured here (2 threads, SmolLM2-135M's shape at INT4 block 32,
# decode steps interleaved with the other settings on a shared machine, bench/cpu_decode.py --variants acc0): 4 is
# 1.5x as fast as 0 at batch 1 and 1.7x at batch 8, for a logit error of 1e-2 of the largest logit (random
# weights, flat logits) and 5e-3 on radreport-tiny's int4 recipe, whose greedy tokens stay the same
# (tests/test_cpu_fast.py). The rule: the cpu target's decoders are INT4/INT8 weight-only models whose recipes were
# checked at float activations; 4 is what onnxruntime-genai ships for them on CPU, and the build's parity figure
# (cpu_fused_parity) records what it moved for each bundle.
ACCURACY_LEVEL = 4
# ORT's CPU GroupQueryAttention refuses other head sizes at run time ("head_size must be a multiple of 8", ORT 1.32)
GQA_HEAD_DIM_MULTIPLE = 8


@dataclass(frozen=True)
class FusedSignature:
    """What the run side reads back from a fused decoder's inputs."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    mrope: bool  # position_ids (3, batch, seq)
    greedy: bool = False  # a `greedy_token` output (decoders lowered since it came)

    @classmethod
    def of(cls, inputs: dict, outputs: dict) -> FusedSignature:
        """From name -> shape maps of a session's inputs and outputs (ORT's NodeArg shapes)."""
        layers = sum(1 for n in inputs if n.startswith(names.PAST_PREFIX) and n.endswith(".key"))
        _, kv_heads, _, head_dim = inputs[names.past_key(0)]
        return cls(
            layers=layers,
            kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            hidden=int(inputs[names.INPUTS_EMBEDS][2]),
            vocab=int(outputs[names.LOGITS][2]),
            mrope=len(inputs[names.POSITION_IDS]) == 3,
            greedy=GREEDY_TOKEN in outputs,
        )


class FuseCpuDecoder(ir.passes.InPlacePass):
    """Lower a portable decoder (after any recipe) to the cpu target's fused decoder, in place.

    `accuracy_level`: what every MatMulNBits gets (None: leave each as the int4 pass wrote it). `fuse_norms`:
    write the RMSNorms as fused norms (off: keep the decomposition, for measuring what the fusion gives)."""

    def __init__(
        self,
        *,
        accuracy_level: int | None = ACCURACY_LEVEL,
        fuse_norms: bool = True,
        pack_qkv: bool = True,
        max_positions: int | None = None,
    ):
        super().__init__()
        if max_positions is not None and max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        self.max_positions = max_positions
        if accuracy_level is not None and accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {accuracy_level}")
        self.accuracy_level = accuracy_level
        self.fuse_norms = fuse_norms
        self.pack_qkv = pack_qkv

    def requires(self, model: ir.Model) -> None:
        inputs = {v.name for v in model.graph.inputs}
        expect(not {SEQLENS_K, TOTAL_SEQUENCE_LENGTH} & inputs, "this decoder is already lowered for the cpu target")
        needed = {names.INPUTS_EMBEDS, names.ATTENTION_MASK, names.POSITION_IDS, names.past_key(0)}
        expect(needed <= inputs, f"not a portable decoder: inputs {sorted(needed - inputs)} missing")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        # everything is found before anything is edited: a decoder this cannot read is refused untouched
        layers = [find_attention(graph, i) for i in range(attention_layers(graph))]
        expect(bool(layers), "the decoder has no attention layers")
        expect(all(a.freqs is layers[0].freqs for a in layers), "layers rotate by different RoPE angles")
        head_dim = layers[0].head_dim
        expect(
            head_dim % GQA_HEAD_DIM_MULTIPLE == 0,
            f"head_dim {head_dim} is not a multiple of {GQA_HEAD_DIM_MULTIPLE}, which ONNX Runtime's CPU "
            "GroupQueryAttention requires",
        )
        norms = find_rms_norms(graph)
        expect(bool(norms) and _reaches(norms[-1].out, names.LOGITS), "no RMSNorm in front of the LM head")
        projections = float_projections(model)

        inputs = {v.name: v for v in graph.inputs}
        seqlens_k = ir.val(SEQLENS_K, ir.DataType.INT32, ["batch"])
        total = ir.val(TOTAL_SEQUENCE_LENGTH, ir.DataType.INT32, [])
        inv_freq = text_angles(layers[0].freqs, inputs[names.POSITION_IDS])
        if inv_freq is not None and self.max_positions is not None:
            rope = position_tables(graph, inv_freq, inputs[names.POSITION_IDS], self.max_positions)
            model.metadata_props[ROPE_POSITIONS] = str(self.max_positions)
        else:
            rope = rope_tables(graph, layers[0].freqs, inputs[names.INPUTS_EMBEDS], total, layers[0].head_dim)
        for a in layers:
            name = f"/model/layers.{a.layer}/self_attn/qkv_proj"
            qkv = pack_projections(graph, [a.q, a.k, a.v], name, projections) if self.pack_qkv else None
            fuse_attention(graph, a, rope, seqlens_k, total, qkv)
        final = [fuse_norm(graph, n) for n in norms][-1] if self.fuse_norms else norms[-1].out
        _last_position(graph, final)
        _greedy_token(graph)

        RemoveUnusedNodesPass()(model)
        leave_unread_outputs_out(graph)
        mask = inputs[names.ATTENTION_MASK]
        expect(not mask.uses(), "attention_mask is still read after the lowering")
        graph.inputs.remove(mask)
        graph.inputs.extend([seqlens_k, total])
        for v in graph.inputs:
            if (v.name or "").startswith(names.PAST_PREFIX):
                shape = _shape(v)
                v.shape = ir.Shape(["batch", shape[1], MAX_SEQ, shape[3]])
        for v in graph.outputs:
            if (v.name or "").startswith(names.PRESENT_PREFIX):
                shape = _shape(v)
                v.shape = ir.Shape(["batch", shape[1], MAX_SEQ, shape[3]])
            elif v.name == names.LOGITS:
                v.shape = ir.Shape(["batch", 1, _shape(v)[2]])
        if self.accuracy_level is not None:
            for node in graph:
                if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
                    node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", self.accuracy_level)
        graph.opset_imports.setdefault(MS_DOMAIN, 1)
        graph.sort()
        return ir.passes.PassResult(model, modified=True)


def _shape(value: ir.Value) -> ir.Shape:
    """A KV or logits value's shape, which the portable export always writes."""
    if value.shape is None:
        raise NotPortable(f"{value.name} has no shape")
    return value.shape


def _last_position(graph: ir.Graph, normed: ir.Value) -> None:
    """Only the last position goes on to the LM head: `Slice(normed, -1:, axis 1)`."""
    nodes = [
        named(
            ir.node("Constant", [], {"value": ir.tensor(np.asarray(x, np.int64))}, name=f"/model/norm/cpu/Constant_{i}")
        )
        for i, x in enumerate(([-1], [np.iinfo(np.int64).max], [1]))
    ]
    last = named(ir.node("Slice", [normed, *(n.outputs[0] for n in nodes)], name="/model/norm/cpu/last_position"))
    graph.insert_after(made_by(normed, "the last position"), [*nodes, last])
    normed.replace_all_uses_with(last.outputs[0])
    last.replace_input_with(0, normed)


def _greedy_token(graph: ir.Graph) -> None:
    """`greedy_token` = ArgMax(logits) over the vocabulary, one per row (ONNX's ArgMax takes the first index of a
    tie, as numpy's argmax does: the engine's greedy tokens are the same either way)."""
    logits = next(v for v in graph.outputs if v.name == names.LOGITS)
    argmax = named(ir.node("ArgMax", [logits], {"axis": -1, "keepdims": 0}, name="/model/greedy_token/ArgMax"))
    token = argmax.outputs[0]
    token.name, token.dtype, token.shape = GREEDY_TOKEN, ir.DataType.INT64, ir.Shape(["batch", 1])
    graph.append(argmax)
    graph.outputs.append(token)


def _reaches(value: ir.Value, output: str) -> bool:
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        if v.name == output and v.is_graph_output():
            return True
        for use in v.uses():
            if id(use.node) not in seen:
                seen.add(id(use.node))
                todo.extend(use.node.outputs)
    return False


def lower_decoder(model: ir.Model, **options) -> ir.Model:
    """`model` lowered in place (see `FuseCpuDecoder`); refuses a decoder it cannot read (`NotPortable`)."""
    return FuseCpuDecoder(**options)(model).model


__all__ = [
    "ACCURACY_LEVEL",
    "FUSED_DECODER",
    "FUSED_ROLE",
    "FuseCpuDecoder",
    "FusedSignature",
    "GREEDY_TOKEN",
    "NotPortable",
    "ROPE_POSITIONS",
    "SEQLENS_K",
    "TOTAL_SEQUENCE_LENGTH",
    "lower_decoder",
]
