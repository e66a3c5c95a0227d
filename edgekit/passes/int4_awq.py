"""AWQ for the INT4 pass: the input scale of each group of MatMuls sharing an input (searched on their output
error), and the graph edit that divides their input by it (folded into the RMSNorm weight in front when there is
one, else a Mul).

Why: a few input channels of a real LLM carry much larger activations than the rest; scaling them up in the weight
(and down in the input) before rounding gives them finer steps where the output feels them most.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from edgekit.ir_values import name_of
from edgekit.onnx_model import NodeNames

from .base import PassChanges
from .int4_config import AWQ_MAX_TOKENS
from .int4_encode import quantize_blocks
from .int4_graph import new_initializer, norm_weight, subsample
from .patterns import WeightMatMul


def awq_scales(
    mms: Sequence[WeightMatMul],
    acts: dict[str, np.ndarray],
    seed: int,
    *,
    grid: int,
    block_for: Callable[[int], int],
    signed_scales: bool,
    symmetric_of: Callable[[WeightMatMul], bool],
) -> dict[str, np.ndarray]:
    """Per activation (shared by a group of MatMuls): s = mean|x|^alpha, alpha chosen among `grid` + 1 points in
    [0, 1] on output error, each MatMul on the grid it will be quantized on (`symmetric_of`). A channel that is zero
    on every calibration token keeps s = 1 and the scale is normalised over the others: mean|x| says nothing about
    it, and the 1e-8 floor made its s tiny (0.04 on the bench's MLP at 32 tokens), so its rounding error came back
    divided by it off the calibration set; with float zero points, which have no exact 0, that made asymmetric
    awq-gptq 1.4x RTN's output error (0.25 against 0.18; 0.069 with s = 1)."""
    groups: dict[str, list[WeightMatMul]] = defaultdict(list)
    for m in mms:
        groups[name_of(m.activation)].append(m)
    out = {}
    for act_name, members in groups.items():
        x = subsample(acts[act_name], seed, AWQ_MAX_TOKENS)
        best = _best_scale(members, x, grid, block_for, signed_scales, symmetric_of)
        if best is not None and not np.allclose(best, 1.0):
            out[act_name] = best.astype(np.float32)
    return out


def _best_scale(
    members: list[WeightMatMul],
    x: np.ndarray,
    grid: int,
    block_for: Callable[[int], int],
    signed_scales: bool,
    symmetric_of: Callable[[WeightMatMul], bool],
) -> np.ndarray | None:
    """The scale of the alpha with the lowest summed output error of `members` on the tokens `x`; None when no
    channel was ever seen."""
    mean_abs = np.abs(x).mean(0)
    live = mean_abs > 0  # the rest were never seen: left unscaled
    if not live.any():
        return None
    mean_abs = mean_abs + 1e-8
    ref = [x @ m.kn() for m in members]
    best, best_err = None, np.inf
    for alpha in np.linspace(0.0, 1.0, grid + 1):
        s = np.ones(mean_abs.shape)  # float64, as mean_abs ** alpha is
        s[live] = mean_abs[live] ** alpha
        s[live] /= np.sqrt(s[live].max() * s[live].min())
        err = 0.0
        for m, y in zip(members, ref):
            qw = quantize_blocks(
                m.kn().T * s[None, :],
                block_for(m.k),
                symmetric=symmetric_of(m),
                scale_search=False,  # a proxy: the final quantizer searches
                signed_scales=signed_scales,
                name=m.weight_name,
            )
            err += float(((x @ (qw.dequantize().T / s[:, None]) - y) ** 2).mean())
        if err < best_err:
            best, best_err = s, err
    return best


def apply_scales(
    model: ir.Model,
    mms: Sequence[WeightMatMul],
    scales: dict[str, np.ndarray],
    changes: PassChanges,
    node_names: NodeNames,
) -> int:
    """x -> x / s in front of each scaled group: folded into a norm's weight when that Mul is theirs alone (the
    count of those is returned), else a Mul the group's MatMuls then read."""
    folded = 0
    for act_name, s in scales.items():
        members = [m for m in mms if m.activation.name == act_name]
        act = members[0].activation
        gamma = norm_weight(act.producer(), act, s.shape[0])
        if gamma is not None:
            assert gamma.const_value is not None and gamma.name is not None  # norm_weight checked both
            gamma.const_value = ir.Tensor((gamma.const_value.numpy() / s).astype(np.float32), name=gamma.name)
            changes.initializers_touched.append(gamma.name)
            folded += 1
            continue
        inv = new_initializer(model.graph, (1.0 / s).astype(np.float32), f"{members[0].name}.awq_inv_scale")
        mul = ir.node("Mul", [act, inv], name=node_names.take(f"{members[0].name}_awq_scale"))
        mul.outputs[0].name = f"{inv.name}_out"
        if act.dtype is not None:
            mul.outputs[0].dtype = act.dtype
        model.graph.insert_before(members[0].node, mul)
        for m in members:
            m.node.replace_input_with(0, mul.outputs[0])
        changes.nodes_added += 1
    return folded
