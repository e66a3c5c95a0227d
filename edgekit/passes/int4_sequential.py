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
- `input_moments`: H_q, E[x x_q^T] and E[x x^T], once per input of a wave.
- `retarget_weight`: how far to move towards W*. W* is fitted from T calibration tokens, K coefficients per
  output row, so its move W* - W carries noise of about K / T of each row's unexplained energy, and with 64 x 32
  tokens most of a row's move can be noise. The move is W M (M = E[(x - x_q) x_q^T] H_q^-1, shared by the
  MatMuls of one input). Its isotropic part, m = tr(M) / K, is the gain that noisy inputs put on a least-squares
  fit (errors in variables: the output from x_q is shrunk towards what x would give); it is one number from every
  token and channel, so it is taken in full. The rest is taken per output row by the positive-part James-Stein
  factor 1 - K_eff s^2 / (T e): e the row's fitted energy, s^2 the energy it leaves unexplained; both are read
  from the moments. `beta` (the pass's `retarget`, 0.5: the lowest mean on the tuning models) takes that share of
  the corrected rest, 0 the gain alone. Before, a fixed 0.35 of the whole move was taken (docs/passes-int4.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

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
class InputMoments:
    """One input's second moments over the same calibration tokens, through the float model (x) and the partly
    quantized one (x_q)."""

    hq: np.ndarray  # E[x_q x_q^T]: GPTQ's Hessian on the quantized inputs
    cross: np.ndarray  # E[x x_q^T]
    hx: np.ndarray  # E[x x^T]
    tokens: int
    _solved: dict = field(default_factory=dict, compare=False, repr=False)  # (ridge, damp) -> _InputFit

    def fit(self, ridge: float, damp: float) -> _InputFit:
        """The per-input pieces of the retarget (one K x K inverse), shared by the MatMuls of this input."""
        key = (ridge, damp)
        if key not in self._solved:
            a_inv = np.linalg.inv(_ridged(self.hq, ridge, damp))
            g = self.cross - self.hq  # E[(x - x_q) x_q^T]
            m = g @ a_inv  # W* - W = W M
            self._solved[key] = _InputFit(
                m=m,
                gain=float(np.trace(m)) / m.shape[0],
                g=g,
                hd=self.hx - self.cross - self.cross.T + self.hq,  # E[(x - x_q)(x - x_q)^T]
                k_eff=float((a_inv * self.hq).sum()),  # tr(A^-1 H_q): the fit's degrees of freedom, K without ridge
            )
        return self._solved[key]


@dataclass(frozen=True)
class _InputFit:
    """What `retarget_weight` needs of one input: M (W* - W = W M), its isotropic gain tr(M) / K,
    G = E[(x - x_q) x_q^T], the input error's covariance, and the fit's degrees of freedom."""

    m: np.ndarray
    gain: float
    g: np.ndarray
    hd: np.ndarray
    k_eff: float


def input_moments(x: np.ndarray, xq: np.ndarray) -> InputMoments:
    """The moments of x and x_q (rows: tokens through the float and the partly quantized model). Computed once per
    input: the MatMuls that share it (q/k/v, gate/up) share them, and GPTQ takes H_q as it is."""
    x, xq = np.asarray(x, np.float64), np.asarray(xq, np.float64)
    tokens = max(x.shape[0], 1)
    return InputMoments(hessian(xq), x.T @ xq / tokens, hessian(x), tokens)


def _ridged(hq: np.ndarray, ridge: float, damp: float) -> np.ndarray:
    """H_q + R, R = ridge diag(H_q) + damp mean(diag H_q) I (solvable with a dead channel too)."""
    d = np.diag(hq)
    a = hq + np.diag(ridge * d + damp * float(np.mean(d)))
    a[np.diag_indices_from(a)] += 1e-12 * (float(np.max(d)) or 1.0)  # a dead channel (diag 0) stays solvable
    return a


def least_squares_target(w: np.ndarray, mom: InputMoments, *, ridge: float, damp: float) -> np.ndarray:
    """W*: the (N, K) weight minimising ||W X - W' X_q||^2 over the tokens + ||(W' - W) R^(1/2)||^2 (`_ridged`:
    towards W where the tokens say little), W + W M. With x_q == x it is W."""
    w = np.asarray(w, np.float64)
    return w + w @ mom.fit(ridge, damp).m


def retarget_weight(w: np.ndarray, mom: InputMoments, *, ridge: float, damp: float, beta: float = 1.0) -> np.ndarray:
    """W moved towards `least_squares_target` by what the tokens tell apart from noise (module docstring): the
    isotropic gain in full, and `beta` of each row's rest scaled by its James-Stein factor."""
    w = np.asarray(w, np.float64)
    fit = mom.fit(ridge, damp)
    move = w @ fit.m
    rest = move - fit.gain * w
    # per row: the output error from the quantized inputs, E|w (x - x_q)|^2, and what the full move leaves of it
    total = _row_quadratic(w, fit.hd, w)
    left = total - 2 * _row_quadratic(move, fit.g.T, w) + _row_quadratic(move, mom.hq, move)
    fitted = _row_quadratic(rest, mom.hq, rest)
    noise = np.maximum(left, 0.0) * fit.k_eff / mom.tokens
    stein = np.clip(1.0 - noise / np.maximum(fitted, 1e-30), 0.0, 1.0)
    return w + fit.gain * w + beta * stein[:, None] * rest


def _row_quadratic(a: np.ndarray, m: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a_n M b_n^T for every row n, through one matrix product (a 3-operand einsum would loop in numpy)."""
    return ((a @ m) * b).sum(axis=1)
