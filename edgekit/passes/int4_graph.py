"""What the INT4 pass does to the graph and its calibration data besides quantizing weight MatMuls: other large
weights as blocked DequantizeLinear, the calibration feeds, releasing a weight once written, finding the RMSNorm
weight an AWQ scale folds into, and the token subsets its searches use."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from edgekit.ir_values import name_of
from edgekit.names import VISION_ENCODER
from edgekit.onnx_model import NodeNames

from .base import PassChanges, PassContext
from .calibration import embedding_table, sample_feeds, vision_feeds
from .int4_config import Int4Config
from .int4_encode import quantize_blocks
from .patterns import add_initializer

OTHER_MIN_ELEMENTS = 4096  # below this a float tensor (a norm, a bias) costs less than its DequantizeLinear node


def quantize_other_weights(
    model: ir.Model, bits: int, block: int, changes: PassChanges, node_names: NodeNames | None = None
) -> list[str]:
    """Float initializers of >= OTHER_MIN_ELEMENTS that are not MatMul weights or Gather tables (a patch Conv's
    kernel, an added position table) -> symmetric blocked DequantizeLinear along their flattened trailing axes,
    reshaped back when they are not 2-D. Why: with the MatMuls at 4 bits these few float tensors are a visible
    share of a small encoder. Consumers see the same shape and dtype."""
    done = []
    node_names = node_names or NodeNames(model.graph)
    for value in list(model.graph.initializers.values()):
        arr = value.const_value.numpy() if value.const_value is not None else None
        if (
            arr is None
            or value.dtype != ir.DataType.FLOAT
            or arr.ndim < 2
            or arr.size < OTHER_MIN_ELEMENTS
            or not value.uses()
            or any(u.node.op_type in ("MatMul", "Gather", "Transpose") for u in value.uses())
        ):
            continue
        name = name_of(value)
        flat = arr.reshape(arr.shape[0], -1).astype(np.float32)
        b = int(np.gcd(block, flat.shape[1]))
        qw = quantize_blocks(flat, b, bits=bits, symmetric=True, name=name)
        signed = (qw.q.astype(np.int16) - 2 ** (bits - 1)).astype(ml_dtypes.int4 if bits == 4 else np.int8)
        dq = ir.node(
            "DequantizeLinear",
            [
                add_initializer(model.graph, signed, f"{name}.q{bits}"),
                add_initializer(model.graph, qw.scales, f"{name}.scales"),
            ],
            {"axis": 1, "block_size": b},
            name=node_names.take(f"{name}_DequantizeLinear"),
        )
        out, nodes = dq.outputs[0], [dq]
        out.name, out.dtype, out.shape = f"{name}_dq", ir.DataType.FLOAT, ir.Shape(list(flat.shape))
        if arr.ndim != 2:
            shape = add_initializer(model.graph, np.asarray(arr.shape, np.int64), f"{name}.shape")
            reshape = ir.node("Reshape", [out, shape], name=node_names.take(f"{name}_Reshape"))
            out = reshape.outputs[0]
            out.name, out.dtype, out.shape = f"{name}_dqr", ir.DataType.FLOAT, ir.Shape(list(arr.shape))
            nodes.append(reshape)
        first = min((u.node for u in value.uses()), key=lambda n: list(model.graph).index(n))
        for node in nodes:
            model.graph.insert_before(first, node)
        value.replace_all_uses_with(out)
        model.graph.initializers.pop(name, None)
        changes.nodes_added += len(nodes)
        changes.initializers_touched.append(name)
        done.append(name)
    return done


def calibration_feeds(model: ir.Model, ctx: PassContext, cfg: Int4Config) -> list[dict[str, np.ndarray]]:
    """Decoder: token-embedding rows as inputs. Vision encoder: the model family's preprocessed calibration
    studies (`calibration.vision_feeds`), falling back to the graph's signature when their shape does not fit."""
    if ctx.graph == VISION_ENCODER:
        feeds = vision_feeds(model, cfg.calib, seed=ctx.seed)
        if feeds:
            return feeds
    return sample_feeds(model, cfg.calib, seq=cfg.seq, seed=ctx.seed, embeddings=embedding_table(ctx.model_dir))


def release_weight(weight: ir.Value) -> None:
    """Unmap a replaced external weight now, so its pages leave the process instead of piling up."""
    release = getattr(weight.const_value, "release", None)
    if release is not None:
        try:
            release()
        except BufferError:  # a numpy view is still alive somewhere: the mapping goes with it later
            pass


def norm_weight(producer: ir.Node | None, act: ir.Value, k: int) -> ir.Value | None:
    """The 1-D weight initializer of a `Mul(normed, weight)` producing `act`, if nothing else reads either."""
    if producer is None or producer.op_type != "Mul" or act.is_graph_output():
        return None
    for v in producer.inputs:
        if (
            v is not None
            and v.is_initializer()
            and v.const_value is not None
            and v.shape is not None
            and list(v.shape) == [k]
            and len(v.uses()) == 1
        ):
            return v
    return None


def new_initializer(graph: ir.Graph, array: np.ndarray, name: str) -> ir.Value:
    return add_initializer(graph, np.ascontiguousarray(array, dtype=np.float32), name)


def held_out(x: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three quarters of the tokens `x` (drawn by `seed`) to fit on, the rest to measure on."""
    order = np.random.default_rng(seed).permutation(x.shape[0])
    cut = max(1, (3 * x.shape[0]) // 4)
    return x[order[:cut]], x[order[cut:]]


def subsample(x: np.ndarray, seed: int, limit: int) -> np.ndarray:
    if x.shape[0] <= limit:
        return x
    idx = np.random.default_rng(seed).choice(x.shape[0], limit, replace=False)
    return x[np.sort(idx)]
