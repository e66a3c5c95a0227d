"""The INT4 pass's plan: which weight MatMuls it quantizes, the calibration activations its method and `mixed`
read, what the method fixes from them first (`Quantizer.calibrate`), which MatMuls stay at `keep_bits`, and how
one MatMul's weight is quantized from all that (`Int4Plan.quantize`), in a wave of the sequential order or alone.

Weights are read per MatMul when quantized and released after (`int4_graph.release_weight`), never all at once:
with external data this keeps the pass at about one float weight in memory, whatever the model size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from edgekit.ir_values import name_of

from .base import PassContext
from .calibration import capture_values
from .gptq import hessian
from .int4_config import HESSIAN_MAX_TOKENS, Int4Config
from .int4_encode import QuantizedWeight
from .int4_graph import calibration_feeds, subsample
from .int4_methods import Calibration, Quantizer, WeightJob
from .int4_sequential import InputFit, input_fit, retarget_weight
from .patterns import WeightMatMul, matches_any

Feeds = list[dict[str, np.ndarray]]


@dataclass
class Wave:
    """MatMuls quantized together: with `live`, each input as the partly quantized graph now feeds it (x / s where
    AWQ's scale is applied), and the fits of the float inputs from those, once per input (`fits`)."""

    matmuls: list[WeightMatMul]
    live: dict[str, np.ndarray] = field(default_factory=dict)
    fits: dict[str, InputFit] = field(default_factory=dict)


@dataclass
class Int4Plan:
    """One run's decisions, fixed before the graph changes (applying AWQ's scales re-points activations: `act_of`
    keeps each MatMul's input as planned)."""

    method: Quantizer
    matmuls: list[WeightMatMul]
    feeds: Feeds
    acts: dict[str, np.ndarray]  # calibration activations by input name (float model)
    calibration: Calibration
    act_of: dict[int, str]  # id(MatMul) -> its input's name
    kept: set[str] = field(default_factory=set)  # MatMul names kept at keep_bits
    sensitivity: dict[str, float] = field(default_factory=dict)  # `mixed`: each MatMul's error quantized alone
    ranked: list[str] = field(default_factory=list)  # `sensitivity`'s names, most sensitive first
    hessians: dict[str, np.ndarray] = field(default_factory=dict)  # of `acts`, computed when first needed

    @property
    def config(self) -> Int4Config:
        return self.method.config

    def scale_of(self, m: WeightMatMul) -> np.ndarray | None:
        return self.calibration.scales.get(self.act_of[id(m)])

    def quantize(self, m: WeightMatMul, bits: int, wave: Wave | None = None) -> QuantizedWeight:
        """`m`'s weight at `bits` with its input's scale and Hessian; in a sequential `wave`, fitted on its input
        from the partly quantized model (GPTAQ: moved towards the float output, Hessian of the quantized inputs)."""
        act, s = self.act_of[id(m)], self.scale_of(m)
        w = m.kn().T  # (N, K)
        live = None if wave is None else wave.live.get(name_of(m.activation))
        h = None
        if wave is not None and live is not None:
            fit = self._fit(wave, m, act, live, s)
            w = retarget_weight(w, fit, beta=self.method.retarget)
            h = fit.hq
        elif act in self.acts and self.method.needs_data:
            h = self._hessian(act)
        if s is not None:  # the weight times s, the Hessian of x / s
            w = w * s[None, :]
            h = None if h is None else h / np.outer(s, s)
        tokens = self.acts[act].shape[0] if act in self.acts else 0
        job = WeightJob(self.config.block_for(m.k), bits, self.calibration.symmetric_of(m), m.weight_name, tokens)
        return self.method.quantize(w, h, job)

    def _fit(self, wave: Wave, m: WeightMatMul, act: str, live: np.ndarray, s: np.ndarray | None) -> InputFit:
        """The fit of `act`'s float values from its quantized ones, once per input of the wave (q/k/v, gate/up
        share theirs, and its K)."""
        if act not in wave.fits:
            ridge = self.config.shrink_for(m.k, self.acts[act].shape[0])
            xq = live if s is None else live * s[None, :]
            wave.fits[act] = input_fit(self.acts[act], xq, ridge=ridge, damp=self.config.damp)
        return wave.fits[act]

    def _hessian(self, act: str) -> np.ndarray:
        if act not in self.hessians:
            self.hessians[act] = hessian(self.acts[act])
        return self.hessians[act]


def plan_int4(model: ir.Model, ctx: PassContext, method: Quantizer, matmuls: list[WeightMatMul]) -> Int4Plan:
    """Capture what the method and `mixed` read, let the method fix its choices, and rank the MatMuls."""
    cfg = method.config
    feeds: Feeds = []
    acts: dict[str, np.ndarray] = {}
    if method.needs_data or cfg.mixed > 0:
        feeds = ctx.feeds() or calibration_feeds(model, ctx, cfg)
        names = sorted({name_of(m.activation) for m in matmuls})
        captured = capture_values(model, names, feeds)
        acts = {k: subsample(v, ctx.seed, HESSIAN_MAX_TOKENS) for k, v in captured.items()}
    plan = Int4Plan(
        method=method,
        matmuls=matmuls,
        feeds=feeds,
        acts=acts,
        calibration=method.calibrate(matmuls, acts, ctx.seed),
        act_of={id(m): name_of(m.activation) for m in matmuls},
    )
    plan.sensitivity = sensitivity(plan) if cfg.mixed > 0 else {}
    plan.ranked = sorted(plan.sensitivity, key=plan.sensitivity.__getitem__, reverse=True)
    plan.kept = set(plan.ranked[: cfg.mixed]) | {m.name for m in matmuls if matches_any(m.name, cfg.keep)}
    return plan


def sensitivity(plan: Int4Plan) -> dict[str, float]:
    """Relative output error of each MatMul quantized alone at 4 bits (on its own calibration activations)."""
    out = {}
    for m in plan.matmuls:
        x = plan.acts[name_of(m.activation)]
        y = x @ m.kn()
        s = plan.scale_of(m)
        wq = plan.quantize(m, 4).dequantize().T
        if s is not None:
            wq = wq / s[:, None]
        out[m.name] = float(np.linalg.norm(x @ wq - y) / (np.linalg.norm(y) + 1e-12))
    return out
