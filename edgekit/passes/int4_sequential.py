"""Sequential INT4 with asymmetric calibration (GPTAQ, Li et al. 2025): the two pieces the `int4` pass needs.

Why: GPTQ fitted on the float model's activations X minimises each layer's error on inputs it will never see;
once the MatMuls before it are quantized, its inputs are X_q. Quantizing in topological waves and capturing X_q
from the model with the earlier waves already quantized lets each layer be fitted to what it will be fed, and
against the FLOAT model's output: minimise ||W X - Q X_q||^2. Expanding, that is a constant plus
||(W* - Q) X_q||^2 with the least-squares target W* = W X X_q^T (X_q X_q^T)^-1, so the fit is "move W to W*,
then GPTQ with H_q = X_q^T X_q" (`retarget_weight`, the identity is tested). W* lets a layer undo the part of
the upstream error that is linear in its inputs.

- `matmul_waves`: weight MatMuls grouped by how many weight MatMuls lie on the longest path to their input
  (q/k/v of a layer share one wave, o_proj the next, gate/up, down, then the next layer's q/k/v ...): one
  calibration run of the partly quantized model per wave captures every input the wave needs.
- `input_moments`: H_q and E[x x_q^T], once per input of a wave.
- `retarget_weight`: W*, ridge-regularised towards W (a calibration set of T tokens fits K channels with noise
  about K / T), and only `beta` of the way (the upstream error is partly nonlinear, e.g. through softmax, and a
  full move chases what a linear layer cannot undo; the pass takes 0.35, the lowest mean on the tuning models, see
  docs/passes-int4.md).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from .gptq import hessian
from .patterns import WeightMatMul


def matmul_waves(model: ir.Model, mms: list[WeightMatMul]) -> list[list[WeightMatMul]]:
    """`mms` in waves: wave d holds the MatMuls with d weight MatMuls on the longest path from the graph's inputs
    to their activation, so every MatMul a wave's inputs depend on is in an earlier wave. Graph order (onnx-ir
    keeps graphs topologically sorted) within a wave."""
    depth: dict[int, int] = {}  # id(value) -> weight MatMuls upstream
    weight_nodes = {id(m.node) for m in mms}
    for node in model.graph:
        d = max((depth.get(id(v), 0) for v in node.inputs if v is not None), default=0)
        d += id(node) in weight_nodes
        for out in node.outputs:
            depth[id(out)] = d
    waves: dict[int, list[WeightMatMul]] = defaultdict(list)
    for m in mms:
        waves[depth.get(id(m.activation), 0)].append(m)
    return [waves[d] for d in sorted(waves)]


def input_moments(x: np.ndarray, xq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """H_q = X_q^T X_q / T (GPTQ's Hessian on the quantized inputs) and the cross moment X^T X_q / T, over the same
    tokens (rows of x, xq: through the float and the partly quantized model). Computed once per input: the
    MatMuls that share it (q/k/v, gate/up) share both, and GPTQ takes H_q as it is."""
    x, xq = np.asarray(x, np.float64), np.asarray(xq, np.float64)
    return hessian(xq), x.T @ xq / max(x.shape[0], 1)


def retarget_weight(
    w: np.ndarray, hq: np.ndarray, cross: np.ndarray, *, ridge: float, damp: float, beta: float = 1.0
) -> np.ndarray:
    """The (N, K) weight minimising ||W X - W' X_q||^2 over the tokens (`input_moments`: hq = E[xq xq^T], cross =
    E[x xq^T]) + ||(W' - W) R^(1/2)||^2, R = ridge diag(H_q) + damp mean(diag H_q) I (towards W where the tokens
    say little), moved `beta` of the way from W. With xq == x it is W."""
    w = np.asarray(w, np.float64)
    d = np.diag(hq)
    reg = np.diag(ridge * d + damp * float(np.mean(d)))
    a = hq + reg
    a[np.diag_indices_from(a)] += 1e-12 * (float(np.max(d)) or 1.0)  # a dead channel (diag 0) stays solvable
    w_star = np.linalg.solve(a, (w @ (cross + reg)).T).T  # A symmetric: (W (C + R)) A^-1
    return w + beta * (w_star - w)
