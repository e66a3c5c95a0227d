"""The INT4 pass's methods, one quantizer each: one base class (`Quantizer`) and one registry by `method` name.

Why: the pass's plan, its sequential waves and its encoding are the same for every method; what differs is what a
method reads (calibration activations or none), what it fixes before quantizing (GPTQ: each MatMul's symmetry;
AWQ: an input scale per group of MatMuls sharing an input) and how it turns one weight into integers. Each of those
is a member of the base class `Quantizer`, so the pass never branches on the method's name, and a new method is
one class here and one line in `QUANTIZERS` (and its name in `int4_config.METHODS`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from edgekit.ir_values import name_of

from .gptq import block_hessians, gptq_quantize, hessian
from .hqq import hqq_quantize
from .int4_awq import awq_scales
from .int4_config import AWQ_CHECK_MARGIN, RETARGET, Int4Config
from .int4_encode import QuantizedWeight, quantize_blocks
from .int4_graph import held_out
from .patterns import WeightMatMul
from .weight_formats import WeightFormat


@dataclass(frozen=True)
class WeightJob:
    """One weight to quantize: its block along K, width, grid, name (for errors) and, for the Hessian it comes
    with, the calibration tokens that Hessian was fitted on (0 without one)."""

    block: int
    bits: int
    symmetric: bool
    name: str
    tokens: int = 0


@dataclass
class Calibration:
    """What a method fixes from the calibration activations before any weight is quantized: the symmetry of the
    MatMuls it chose one for (else `default`), and the input scales (by activation name) of AWQ's groups, with
    what its check dropped and measured."""

    default: bool
    chosen: dict[str, bool] = field(default_factory=dict)  # MatMul name -> symmetric
    scales: dict[str, np.ndarray] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # inputs whose AWQ scale the check took away
    check: dict[str, float] = field(default_factory=dict)  # first MatMul of an input -> error ratio

    def symmetric_of(self, m: WeightMatMul) -> bool:
        return self.chosen.get(m.name, self.default)


@dataclass(frozen=True)
class Quantizer:
    """One INT4 method, built from the pass's config and weight format (`QUANTIZERS[method](config, format)`).
    A method overrides `quantize` (one weight to integers), and `calibrate` where it fixes something from the
    calibration activations first; it says whether it reads them (`needs_data`: the pass then captures them and
    hands each weight its input's Hessian) and whether it is fitted wave by wave on the partly quantized model's
    inputs (`sequential`, GPTAQ: `int4_sequential`). The rest are the defaults the config and format resolve to."""

    config: Int4Config
    format: WeightFormat
    needs_data: ClassVar[bool] = False
    gptq: ClassVar[bool] = False  # a GPTQ method: float zero points by default, sequential unless set false

    @property
    def symmetric(self) -> bool:
        """`symmetric` as set, else asymmetric where the format takes zero points (matmulnbits), else symmetric."""
        if self.config.symmetric is not None:
            return self.config.symmetric
        return not self.format.zero_points

    @property
    def float_zeros(self) -> bool:
        """`float_zeros` as set, or on with the GPTQ methods where the format takes them (qdq-blocked takes none)."""
        if self.config.float_zeros is not None:
            return self.config.float_zeros
        return self.format.float_zero_points and self.gptq

    @property
    def sequential(self) -> bool:
        """On for the GPTQ methods unless set false (validate refuses it for the others)."""
        return self.gptq and self.config.sequential is not False

    @property
    def retarget(self) -> float:
        """`retarget` as set, or RETARGET (validate refuses it where nothing is sequential)."""
        return RETARGET if self.config.retarget is None else self.config.retarget

    def calibrate(self, mms: Sequence[WeightMatMul], acts: dict[str, np.ndarray], seed: int) -> Calibration:
        """Nothing to fix beforehand: every MatMul on the default grid, no input scales."""
        return Calibration(default=self.symmetric)

    def quantize(self, w: np.ndarray, h: np.ndarray | None, job: WeightJob) -> QuantizedWeight:
        """`w` (N, K), already scaled (and retargeted) for its input, with that input's Hessian `h` (K, K) where
        the method reads calibration data."""
        raise NotImplementedError

    def awq_scales(
        self, mms: Sequence[WeightMatMul], acts: dict[str, np.ndarray], seed: int, cal: Calibration
    ) -> dict[str, np.ndarray]:
        """AWQ's input scales (`int4_awq.awq_scales`), each MatMul searched on the grid `cal` gives it."""
        return awq_scales(
            mms,
            acts,
            seed,
            grid=self.config.awq_grid,
            block_for=self.config.block_for,
            signed_scales=self.format.signed_scales,
            symmetric_of=cal.symmetric_of,
        )


@dataclass(frozen=True)
class RtnQuantizer(Quantizer):
    """Round to nearest, block-wise, with the range-shrink (`clip`) and scale searches of `quantize_blocks`;
    weighted by each block's Hessian where the method has one (AWQ)."""

    default_clip: ClassVar[int] = 0

    def quantize(self, w: np.ndarray, h: np.ndarray | None, job: WeightJob) -> QuantizedWeight:
        cfg = self.config
        return quantize_blocks(
            w,
            job.block,
            hessian=None if h is None else block_hessians(h, job.block),
            clip_grid=cfg.clip or self.default_clip,
            scale_search=cfg.scale_search,
            signed_scales=self.format.signed_scales,  # MatMulNBits takes negative scales; TRT's DequantizeLinear not
            refine=cfg.refine,
            bits=job.bits,
            symmetric=job.symmetric,
            name=job.name,
            float_zeros=self.float_zeros and job.bits == 4,
        )


@dataclass(frozen=True)
class HqqQuantizer(Quantizer):
    """HQQ's data-free l_p refinement of RTN's scales (`hqq.py`); integer zero points only."""

    def quantize(self, w: np.ndarray, h: np.ndarray | None, job: WeightJob) -> QuantizedWeight:
        return hqq_quantize(
            w, job.block, signed_scales=self.format.signed_scales, bits=job.bits, symmetric=job.symmetric, name=job.name
        )


@dataclass(frozen=True)
class AwqQuantizer(RtnQuantizer):
    """AWQ: an input scale per group of MatMuls sharing an input (`int4_awq.awq_scales`), then RTN weighted by the
    scaled Hessian, with the range search on by default."""

    needs_data: ClassVar[bool] = True
    default_clip: ClassVar[int] = 10

    def calibrate(self, mms: Sequence[WeightMatMul], acts: dict[str, np.ndarray], seed: int) -> Calibration:
        cal = super().calibrate(mms, acts, seed)
        cal.scales = self.awq_scales(mms, acts, seed, cal)
        return cal


@dataclass(frozen=True)
class GptqQuantizer(Quantizer):
    """GPTQ (`gptq.py`) with this pass's settings; where the format takes zero points and `symmetric` is unset,
    each MatMul gets the symmetry with the lower held-out error, chosen before anything else fits a grid."""

    needs_data: ClassVar[bool] = True
    gptq: ClassVar[bool] = True

    def quantize(self, w: np.ndarray, h: np.ndarray | None, job: WeightJob) -> QuantizedWeight:
        assert h is not None  # needs_data: the pass hands every GPTQ weight its Hessian
        return self.gptq_of(w, h, job)

    def gptq_of(self, w: np.ndarray, h: np.ndarray, job: WeightJob, *, check: bool = False) -> QuantizedWeight:
        """GPTQ of `w` (N, K), shrunk for a Hessian fitted on `job.tokens` tokens: the same quantizer for the MatMuls
        and for the held-out checks that choose their symmetry and AWQ scales, except that a `check` skips the code
        sweeps (each one costs about a GPTQ, and the checks run GPTQ four times per MatMul)."""
        cfg = self.config
        return gptq_quantize(
            w,
            h,
            job.block,
            bits=job.bits,
            symmetric=job.symmetric,
            damp=cfg.damp,
            shrink=cfg.shrink_for(w.shape[1], job.tokens),
            clip_grid=cfg.clip or 10,
            scale_search=cfg.scale_search,
            signed_scales=self.format.signed_scales,  # MatMulNBits takes negative scales; TRT's DequantizeLinear not
            float_zeros=self.float_zeros and job.bits == 4,
            code_sweeps=0 if check else cfg.code_sweeps,
            name=job.name,
        )

    def calibrate(self, mms: Sequence[WeightMatMul], acts: dict[str, np.ndarray], seed: int) -> Calibration:
        # chosen first, so that AWQ's scale search and its check fit the grid each MatMul will get (before, both
        # ran asymmetric and a MatMul then quantized symmetric kept a scale fitted for the other grid)
        cal = super().calibrate(mms, acts, seed)
        if self.config.symmetric is None and self.format.zero_points:
            for m in mms:
                if m.activation.name in acts:
                    w, x = m.kn().T, acts[name_of(m.activation)]
                    cal.chosen[m.name] = self.symmetric_fits_better(w, x, self.config.block_for(m.k), seed)
        return cal

    def symmetric_fits_better(self, w: np.ndarray, x: np.ndarray, block: int, seed: int) -> bool:
        """Whether symmetric GPTQ of `w` (N, K) has no higher output error than asymmetric, fitted on three
        quarters of the calibration tokens `x` and measured on the rest. Why per MatMul: a zero point pays where a
        block's weights are skewed, and costs a step where they are not; the bench's models disagree on which."""
        fit, val = held_out(x, seed + 1)
        if val.shape[0] == 0:
            return False
        h = hessian(fit)
        y = val @ w.T
        err = {}
        for symmetric in (True, False):
            job = WeightJob(block, 4, symmetric, "weight", fit.shape[0])
            qw = self.gptq_of(w, h, job, check=True)
            err[symmetric] = float(((val @ qw.dequantize().T - y) ** 2).sum())
        return err[True] <= err[False]


@dataclass(frozen=True)
class AwqGptqQuantizer(GptqQuantizer):
    """GPTQ, with AWQ's scale for each input where (`awq_check`) GPTQ's held-out error with it is not clearly
    higher than without: the scale is chosen on RTN's error, and GPTQ, which already compensates along the input
    channels, sometimes does better without."""

    def calibrate(self, mms: Sequence[WeightMatMul], acts: dict[str, np.ndarray], seed: int) -> Calibration:
        cal = super().calibrate(mms, acts, seed)
        cal.scales = self.awq_scales(mms, acts, seed, cal)
        if self.config.awq_check:
            for act_name in list(cal.scales):
                members = [m for m in mms if m.activation.name == act_name]
                ratio = self.scaled_error_ratio(members, acts[act_name], cal.scales[act_name], seed, cal.symmetric_of)
                cal.check[members[0].name] = round(ratio, 4)
                if ratio >= AWQ_CHECK_MARGIN:
                    cal.dropped.append(act_name)
                    del cal.scales[act_name]
        return cal

    def scaled_error_ratio(
        self, members: list[WeightMatMul], x: np.ndarray, s: np.ndarray, seed: int, symmetric_of: Callable
    ) -> float:
        """Output error of GPTQ of this input's MatMuls with AWQ's scale over that without, fitted on three
        quarters of the calibration tokens and measured on the rest."""
        fit, val = held_out(x, seed)
        if val.shape[0] == 0:
            return 0.0
        h = hessian(fit)
        err = {False: 0.0, True: 0.0}
        for m in members:
            w = m.kn().T
            y = val @ w.T
            job = WeightJob(self.config.block_for(m.k), 4, symmetric_of(m), m.weight_name, fit.shape[0])
            for scaled in (False, True):
                qw = self.gptq_of(w * s[None, :] if scaled else w, h / np.outer(s, s) if scaled else h, job, check=True)
                wq = qw.dequantize() / s[None, :] if scaled else qw.dequantize()
                err[scaled] += float(((val @ wq.T - y) ** 2).sum())
        return err[True] / max(err[False], 1e-30)


QUANTIZERS: dict[str, type[Quantizer]] = {
    "rtn": RtnQuantizer,
    "hqq": HqqQuantizer,
    "awq": AwqQuantizer,
    "gptq": GptqQuantizer,
    "awq-gptq": AwqGptqQuantizer,
}
