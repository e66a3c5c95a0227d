"""Attention-head importance on calibration data, and head pruning that keeps every shape.

What is computed, and why. The ideal sensitivity of a head is S = |dL/dw| * |E[a]| (weight-activation joint
sensitivity). Without gradients (no torch, no labels at build time) we use what removing the head actually does
to the model: head h of a layer adds c_h = W_o[:, h] a_h to the residual stream, where a_h is the head's
attention output (the input of o_proj, sliced to the head) and W_o[:, h] its o_proj columns. Removing the head
changes the residual by exactly -c_h, so, to first order, the loss changes by dL/dy . c_h, which |c_h| bounds.
The score is therefore

    S[l, h] = E_tokens || W_o[:, h] a_h(t) ||_2        (mean over non-padding calibration tokens)

which is the brief's "per-head output norm x o_proj column norm", measured jointly rather than as a product of
norms (the product over-counts heads whose output falls in o_proj's weak directions). Also reported per head:
E||a_h|| (activation) and ||W_o[:, h]||_F (weight). Layers differ in residual scale, so heads are ranked globally
by their *share* of their layer's total, S / sum_h S; a head with zero o_proj columns scores exactly 0.

Pruning zeroes the head's q_proj rows and o_proj columns: shapes, K/V projections and the KV-cache layout stay as
they are (GQA shares K/V between query heads), so the x1 runtime can also skip heads dynamically with the same
scores, which go to `head_importance.json` in the bundle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from edgekit import names
from edgekit.ir_values import name_of
from edgekit.names import DECODER, EMBED_TOKENS
from edgekit.positions import for_rank

from .base import GraphPass, PassChanges, PassContext, PassPreconditionError
from .config import PassConfig, param
from .patterns import WeightMatMul, find_weight_matmuls, static_dim
from .sparsity import sparsity, write_kn

SCORES_FILE = names.HEAD_IMPORTANCE_FILE
SCORES_VERSION = 1


@dataclass
class AttentionLayer:
    prefix: str  # e.g. model.layers.0.self_attn
    q: WeightMatMul
    o: WeightMatMul
    heads: int
    head_dim: int


def _reshape_head_dim(q: WeightMatMul) -> int | None:
    """head_dim from the `Reshape(.., [0, 0, heads, head_dim])` that follows q_proj (through a bias Add)."""
    frontier = [q.node.outputs[0]]
    for _ in range(2):
        nxt = []
        for v in frontier:
            for use in v.uses():
                node = use.node if hasattr(use, "node") else use[0]
                if node.op_type == "Reshape":
                    shape = node.inputs[1]
                    const = shape.const_value if shape is not None else None
                    producer = shape.producer() if shape is not None else None
                    if const is None and producer is not None and producer.op_type == "Constant":
                        const = producer.attributes["value"].as_tensor()
                    if const is not None:
                        dims = const.numpy().tolist()
                        if len(dims) == 4 and dims[-1] > 0:
                            return int(dims[-1])
                elif node.op_type == "Add":
                    nxt.append(node.outputs[0])
        frontier = nxt
    return None


def attention_layers(model: ir.Model, head_dim: int = 0) -> list[AttentionLayer]:
    """Every (q_proj, o_proj) pair in the graph, with its head count, in graph order."""
    by_name = {mm.name: mm for mm in find_weight_matmuls(model)}
    layers = []
    for name, o in by_name.items():
        if not name.endswith(".o_proj"):
            continue
        prefix = name[: -len(".o_proj")]
        q = by_name.get(prefix + ".q_proj")
        if q is None:
            continue
        hd = head_dim or _reshape_head_dim(q)
        if not hd or q.n % hd or o.k != q.n:
            raise PassPreconditionError(
                f"heads: cannot tell the head layout of {prefix} (q_proj N={q.n}, "
                f"o_proj K={o.k}, head_dim={hd}); set head_dim"
            )
        layers.append(AttentionLayer(prefix, q, o, q.n // hd, hd))
    return layers


# --------------------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------------------
def decoder_feeds(inputs_embeds: np.ndarray, model: ir.Model) -> dict[str, np.ndarray]:
    """Prefill feeds (no past) for one batch of embeddings, in the decoder's input signature."""
    b, s, _ = inputs_embeds.shape
    rank = next((len(v.shape) for v in model.graph.inputs if v.name == names.POSITION_IDS and v.shape), 2)
    feeds: dict[str, np.ndarray] = {
        names.INPUTS_EMBEDS: inputs_embeds.astype(np.float32),
        names.ATTENTION_MASK: np.ones((b, s), np.int64),
        # text positions in the decoder's rank (M-RoPE's (3, batch, seq): the same on the three axes)
        names.POSITION_IDS: for_rank(np.tile(np.arange(s, dtype=np.int64), (b, 1)), rank),
    }
    for v in model.graph.inputs:
        name = name_of(v)
        if name.startswith(names.PAST_PREFIX):
            kv_heads, head_dim = static_dim(v, 1), static_dim(v, 3)
            feeds[name] = np.zeros((b, kv_heads, 0, head_dim), np.float32)
    return feeds


def default_calibration(
    model: ir.Model, model_dir: Path | None, *, samples: int = 8, seq: int = 48, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """Calibration feeds when none are given: random token ids through the model's own embedding table when the
    sibling `embed_tokens.onnx` is there (realistic activation scale), else unit-normal embeddings."""
    rng = np.random.default_rng(seed)
    hidden = static_dim(model.graph.inputs[0], -1)
    table = None
    if model_dir is not None and (Path(model_dir) / EMBED_TOKENS).is_file():
        inits = onnx.load(str(Path(model_dir) / EMBED_TOKENS)).graph.initializer
        table = onnx.numpy_helper.to_array(inits[0]) if len(inits) == 1 else None
    if table is not None:
        embeds = table[rng.integers(5, table.shape[0], size=(samples, seq))]
    else:
        embeds = rng.standard_normal((samples, seq, hidden)).astype(np.float32)
    return [decoder_feeds(embeds[i : i + 1], model) for i in range(samples)]


def head_outputs(model: ir.Model, layers: list[AttentionLayer], feeds: list[dict[str, np.ndarray]]):
    """Run the model once per feed with each o_proj input exposed as an output; yields (feed, [per layer
    (tokens, heads*head_dim)]) restricted to non-padding tokens."""
    import onnxruntime as ort

    proto = ir.to_proto(model)
    wanted_outputs = [name_of(layer.o.activation) for layer in layers]
    for n in wanted_outputs:
        proto.graph.output.append(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # one thread: the same sums in the same order on every run
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    for feed in feeds:
        outs = sess.run(wanted_outputs, {k: v for k, v in feed.items() if k in wanted})
        mask = feed.get(names.ATTENTION_MASK)
        keep = mask[:, -outs[0].shape[1] :].astype(bool) if mask is not None else None
        yield [o[keep] if keep is not None else o.reshape(-1, o.shape[-1]) for o in outs]


def head_importance(model: ir.Model, feeds: list[dict[str, np.ndarray]], head_dim: int = 0) -> dict:
    """Per-layer, per-head scores (see the module docstring), as the JSON document written to the bundle."""
    layers = attention_layers(model, head_dim)
    if not layers:
        raise PassPreconditionError("heads: no attention layer (q_proj + o_proj weight MatMuls) in the graph")
    score = [np.zeros(L.heads) for L in layers]
    act = [np.zeros(L.heads) for L in layers]
    tokens = 0
    w_o = [L.o.kn() for L in layers]  # (heads*hd, hidden): rows of head h are its o_proj columns
    for outs in head_outputs(model, layers, feeds):
        tokens += outs[0].shape[0]
        for i, (L, a) in enumerate(zip(layers, outs)):
            a = a.astype(np.float64).reshape(-1, L.heads, L.head_dim)
            for h in range(L.heads):
                rows = slice(h * L.head_dim, (h + 1) * L.head_dim)
                score[i][h] += np.linalg.norm(a[:, h] @ w_o[i][rows], axis=-1).sum()
                act[i][h] += np.linalg.norm(a[:, h], axis=-1).sum()
    doc_layers = []
    for i, L in enumerate(layers):
        s = score[i] / max(tokens, 1)
        total = s.sum()
        doc_layers.append(
            {
                "layer": i,
                "module": L.prefix,
                "heads": L.heads,
                "head_dim": L.head_dim,
                "score": [float(x) for x in s],
                "share": [float(x) for x in (s / total if total > 0 else np.zeros_like(s))],
                "activation_norm": [float(x) for x in act[i] / max(tokens, 1)],
                "o_proj_norm": [
                    float(np.linalg.norm(w_o[i][h * L.head_dim : (h + 1) * L.head_dim])) for h in range(L.heads)
                ],
            }
        )
    return {
        "version": SCORES_VERSION,
        "method": "E_tokens ||W_o[:, h] a_h||_2 on calibration prefill; share = score / layer total",
        "calibration_tokens": int(tokens),
        "layers": doc_layers,
    }


def heads_to_prune(doc: dict, ratio: float, min_heads_per_layer: int = 1) -> list[tuple[int, int]]:
    """(layer, head) pairs to remove: the lowest shares globally, `round(ratio * total heads)` of them, never
    leaving a layer with fewer than `min_heads_per_layer`. Ties go to the earlier layer and head."""
    entries = [(share, li, h) for li, L in enumerate(doc["layers"]) for h, share in enumerate(L["share"])]
    budget = int(round(ratio * len(entries)))
    left = {li: L["heads"] for li, L in enumerate(doc["layers"])}
    chosen: list[tuple[int, int]] = []
    for _share, li, h in sorted(entries):
        if len(chosen) >= budget:
            break
        if left[li] > min_heads_per_layer:
            chosen.append((li, h))
            left[li] -= 1
    return sorted(chosen)


def zero_heads(layer: AttentionLayer, heads: list[int]) -> None:
    """Zero q_proj output rows and o_proj input columns of `heads`, in the initializers' own layout."""
    q, o = np.array(layer.q.kn()), np.array(layer.o.kn())  # q: (hidden, heads*hd); o: (heads*hd, hidden)
    for h in heads:
        sl = slice(h * layer.head_dim, (h + 1) * layer.head_dim)
        q[:, sl] = 0.0
        o[sl, :] = 0.0
    write_kn(layer.q, q)
    write_kn(layer.o, o)


# --------------------------------------------------------------------------------------------------------------
# the pass
# --------------------------------------------------------------------------------------------------------------
@dataclass
class HeadPruneConfig(PassConfig):
    ratio: float = param(0.38, min=0.0, max=0.95, help="fraction of all attention heads removed (0: score only)")
    min_heads_per_layer: int = param(1, min=0, help="heads every layer keeps")
    head_dim: int = param(0, min=0, help="head size (0: read from the graph's q_proj Reshape)")
    samples: int = param(8, min=1, help="calibration sequences when the context brings none")
    scores_out: str = param("", help=f"where to write the scores JSON ({SCORES_FILE} in the bundle)")


class HeadPrunePass(GraphPass):
    """Rank attention heads by calibration-measured contribution and zero the lowest."""

    name = "heads"
    Config = HeadPruneConfig
    config: HeadPruneConfig  # what GraphPass.__init__ checks it is
    graphs = (DECODER,)

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        if not attention_layers(model, self.config.head_dim):
            raise PassPreconditionError("heads: no attention layer (q_proj + o_proj weight MatMuls) in the graph")

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        c = self.config
        feeds = ctx.feeds(DECODER) or default_calibration(model, ctx.model_dir, samples=c.samples, seed=ctx.seed)
        doc = head_importance(model, feeds, c.head_dim)
        pruned = heads_to_prune(doc, c.ratio, c.min_heads_per_layer)
        layers = attention_layers(model, c.head_dim)
        per_layer = {}
        for li, (L, entry) in enumerate(zip(layers, doc["layers"])):
            mine = [h for (l2, h) in pruned if l2 == li]
            entry["pruned"] = mine
            if mine:
                zero_heads(L, mine)
            per_layer[L.prefix] = {
                "heads_pruned": len(mine),
                "q_proj": round(sparsity(L.q.kn()), 6),
                "o_proj": round(sparsity(L.o.kn()), 6),
            }
        total = sum(L.heads for L in layers)
        doc["pruned_ratio"] = len(pruned) / total
        if c.scores_out:
            Path(c.scores_out).parent.mkdir(parents=True, exist_ok=True)
            Path(c.scores_out).write_text(json.dumps(doc, indent=1))
        touched = sorted(
            {w for li in {l2 for l2, _ in pruned} for w in (layers[li].q.weight_name, layers[li].o.weight_name)}
        )
        return PassChanges(
            initializers_touched=touched,
            notes={
                "heads_pruned": len(pruned),
                "heads_total": total,
                "pruned_ratio": round(len(pruned) / total, 6),
                "sparsity_per_layer": per_layer,
                "head_importance": doc,
            },
        )
