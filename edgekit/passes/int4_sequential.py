"""Sequential INT4 with asymmetric calibration (GPTAQ, Li et al. 2025): the pieces the `int4` pass needs.

Why: GPTQ fitted on the float model's activations X minimises each layer's error on inputs it will never see;
once the MatMuls before it are quantized, its inputs are X_q. Quantizing in topological waves and capturing X_q
from the model with the earlier waves already quantized lets each layer be fitted to what it will be fed, and
against the FLOAT model's output: minimise ||W X - Q X_q||^2. Expanding, that is a constant plus
||(W* - Q) X_q||^2 with the least-squares target W* = W X X_q^T (X_q X_q^T)^-1, so the fit is "move W to W*,
then GPTQ with H_q = X_q^T X_q" (`least_squares_target`, the identity is tested). W* lets a layer undo the part
of the upstream error that is linear in its inputs.

- `matmul_waves`: weight MatMuls grouped by how many weight MatMuls lie on the longest path to their input
  (q/k/v of a layer share one wave, o_proj the next, gate/up, down, then the next layer's q/k/v ...): one
  calibration run of the partly quantized model per wave captures every input the wave needs.
- `input_fit`: H_q and the ridged fit of x from x_q (M below), once per input of a wave.
- `retarget_weight`: how far to move towards W*. W* is fitted from T calibration tokens, K coefficients per output
  row, so its move W* - W carries noise of about K / T of each row's unexplained energy, and at the default 128 x 32
  tokens (K = 128-256 on the bench's LLaVA decoders) much of a row's move can still be noise. The move is W M (M =
  E[(x - x_q) x_q^T] H_q^-1, shared by the MatMuls of one input). Its isotropic part, m = tr(M) / K, is the gain
  that noisy inputs put on a least-squares fit (errors in variables: the output from x_q is shrunk towards what x
  would give); it is one number from every token and channel, so it is taken in full. The rest is taken per output
  row by the positive-part James-Stein factor 1 - K_eff s^2 / (T e): e the row's fitted energy, s^2 the energy it
  leaves unexplained; both are read from the moments. `beta` (the pass's `retarget`, 0.7: the lowest mean on the
  tuning models) takes that share of the corrected rest, 0 the gain alone. Before, a fixed 0.35 of the whole move
  was taken (docs/passes-int4.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

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


@dataclass(frozen=True)
class InputFit:
    """One input's least-squares fit of the float values from the quantized ones, over the same calibration tokens
    (through the float model: x; the partly quantized one: x_q). Built once per input of a wave: the MatMuls that
    read it (q/k/v, gate/up) share it, and GPTQ takes `hq` as it is."""

    hq: np.ndarray  # E[x_q x_q^T]: GPTQ's Hessian on the quantized inputs
    m: np.ndarray  # W* - W = W M
    gain: float  # tr(M) / K, the isotropic part of M
    g: np.ndarray  # E[(x - x_q) x_q^T]
    hd: np.ndarray  # E[(x - x_q)(x - x_q)^T]: the input error's covariance
    k_eff: float  # tr(A^-1 H_q): the fit's degrees of freedom, K without ridge
    tokens: int


def input_fit(x: np.ndarray, xq: np.ndarray, *, ridge: float, damp: float) -> InputFit:
    """The moments of x and x_q (rows: tokens) and the ridged fit between them (`_ridged`: towards W where the
    tokens say little), with its one K x K inverse."""
    x, xq = np.asarray(x, np.float64), np.asarray(xq, np.float64)
    tokens = max(x.shape[0], 1)
    hq, cross = hessian(xq), x.T @ xq / tokens
    a_inv = np.linalg.inv(_ridged(hq, ridge, damp))
    g = cross - hq
    m = g @ a_inv
    return InputFit(
        hq=hq,
        m=m,
        gain=float(np.trace(m)) / m.shape[0],
        g=g,
        hd=hessian(x) - cross - cross.T + hq,
        k_eff=float((a_inv * hq).sum()),
        tokens=tokens,
    )


def _ridged(hq: np.ndarray, ridge: float, damp: float) -> np.ndarray:
    """H_q + R, R = ridge diag(H_q) + damp mean(diag H_q) I (solvable with a dead channel too)."""
    d = np.diag(hq)
    a = hq + np.diag(ridge * d + damp * float(np.mean(d)))
    a[np.diag_indices_from(a)] += 1e-12 * (float(np.max(d)) or 1.0)  # a dead channel (diag 0) stays solvable
    return a


def least_squares_target(w: np.ndarray, fit: InputFit) -> np.ndarray:
    """W*: the (N, K) weight minimising ||W X - W' X_q||^2 over the tokens + ||(W' - W) R^(1/2)||^2 (`_ridged`),
    W + W M. With x_q == x it is W."""
    w = np.asarray(w, np.float64)
    return w + w @ fit.m


def retarget_weight(w: np.ndarray, fit: InputFit, *, beta: float = 1.0) -> np.ndarray:
    """W moved towards `least_squares_target` by what the tokens tell apart from noise (module docstring): the
    isotropic gain in full, and `beta` of each row's rest scaled by its James-Stein factor."""
    w = np.asarray(w, np.float64)
    move = w @ fit.m
    rest = move - fit.gain * w
    # per row: the output error from the quantized inputs, E|w (x - x_q)|^2, and what the full move leaves of it
    total = _row_quadratic(w, fit.hd, w)
    left = total - 2 * _row_quadratic(move, fit.g.T, w) + _row_quadratic(move, fit.hq, move)
    fitted = _row_quadratic(rest, fit.hq, rest)
    noise = np.maximum(left, 0.0) * fit.k_eff / fit.tokens
    stein = np.clip(1.0 - noise / np.maximum(fitted, 1e-30), 0.0, 1.0)
    return w + fit.gain * w + beta * stein[:, None] * rest


def _row_quadratic(a: np.ndarray, m: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a_n M b_n^T for every row n, through one matrix product (a 3-operand einsum would loop in numpy)."""
    return ((a @ m) * b).sum(axis=1)
