"""INT4 weight-only quantization of every weight MatMul: RTN or AWQ-style activation-aware scaling, block-wise
along K, with mixed precision by measured sensitivity, written in the weight format `format` names
(`weight_formats.py`: the format's encoder, and its constraints: zero points, negative scales, opset).

Why these pieces:
- RTN with an optional per-block range-shrink search (`clip`) is the weight-only baseline.
- `method=awq` measures calibration activations, scales each input channel by `mean|x|^alpha` (alpha searched per
  group of MatMuls sharing an input, on their real output error), folds the inverse scale into the RMSNorm weight
  in front when there is one (else a Mul), and weights the range search by each channel's activation energy.
  This is what protects the few outlier channels real LLMs have.
- `mixed=N` quantizes each MatMul alone, measures its output error on the calibration activations, and keeps the
  N most sensitive at `keep_bits` (8, or 32 = untouched); `keep=lm_head` pins modules by name. The choice and the
  measured errors go into the report.
- `graphs=decoder;vision` extends the pass to the vision encoder's weight MatMuls (SigLIP layers and connector;
  the patch Conv stays float). The default stays the decoder alone, which is what the x1 build and older recipes
  expect. A recipe that wants different settings per graph lists the pass twice, each with its own `graphs`.
  Calibration for the vision encoder is the model family's preprocessed calibration studies, not noise.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.ir_values import name_of
from edgekit.onnx_model import NodeNames

from .base import GraphPass, PassChanges, PassContext
from .calibration import capture_values
from .int4_awq import apply_scales
from .int4_config import CALIB_SAMPLES, GRAPHS, HESSIAN_MAX_TOKENS, METHODS, RETARGET, Int4Config
from .int4_encode import check_block
from .int4_graph import new_initializer, quantize_other_weights, release_weight, subsample
from .int4_methods import QUANTIZERS, Quantizer
from .int4_plan import Int4Plan, Wave, plan_int4
from .int4_sequential import matmul_waves
from .patterns import WeightMatMul, matches_any, remove_if_unused, require_weight_matmuls
from .weight_formats import WeightFormat

__all__ = ["CALIB_SAMPLES", "METHODS", "RETARGET", "Int4Config", "Int4Pass", "quantize_other_weights"]


@dataclass
class Encoded:
    """What the encode step wrote: MatMuls by precision, and how many carry float zero points (MatMulNBits: 32
    bits per block instead of 4)."""

    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    float_zero_points: int = 0
    waves: int = 0  # sequential waves run (0: not sequential)


class Int4Pass(GraphPass):
    name = "int4"
    Config = Int4Config
    graphs = tuple(GRAPHS.values())  # the ones it can run on; `config.graphs` picks among them
    config: Int4Config  # what GraphPass.__init__ checks it is

    def applies_to(self, graph: str) -> bool:
        return graph in {GRAPHS[g] for g in self.config.graphs}

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        mms = self._matmuls(model, ctx)
        if not mms:
            raise ConfigError("int4.exclude: every weight MatMul is excluded, nothing to quantize")
        for m in mms:  # refuse before touching anything
            check_block(m.k, self.block_for(m.k), m.weight_name)

    @property
    def format(self) -> WeightFormat:
        """The weight format this pass writes (`format`, or what the deprecated `target` or no choice means)."""
        return self.config.weight_format()

    @property
    def method(self) -> Quantizer:
        """The quantizer of `method` (`int4_methods.QUANTIZERS`), with this config and format."""
        return QUANTIZERS[self.config.method](self.config, self.format)

    def min_opset(self) -> int | None:
        """The default-domain opset the result needs: the format's (qdq-blocked: 21; MatMulNBits is a
        com.microsoft op and needs none), and 21 for `other_bits` (blocked DequantizeLinear)."""
        needs = [n for n in (self.format.min_opset, 21 if self.config.other_bits else None) if n is not None]
        return max(needs) if needs else None

    @property
    def symmetric(self) -> bool:
        """`symmetric` as set, else asymmetric where the format takes zero points (matmulnbits), else symmetric."""
        return self.method.symmetric

    @property
    def float_zeros(self) -> bool:
        """`float_zeros` as set, or on with the GPTQ methods where the format takes them (qdq-blocked takes none)."""
        return self.method.float_zeros

    def block_for(self, k: int) -> int:
        """`block`, or with `fit_block` the largest allowed block <= it that divides K (checked by the caller)."""
        return self.config.block_for(k)

    # ---------------------------------------------------------------------------------------------------------
    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        """plan (which MatMuls, the calibration they need, what the method fixes from it, which stay at
        `keep_bits`) -> waves (the sequential order, where the method fits each wave on the partly quantized
        model) -> encode (each MatMul written in the weight format)."""
        plan = plan_int4(model, ctx, self.method, self._matmuls(model, ctx))
        changes, node_names = PassChanges(), NodeNames(model.graph)
        folded = apply_scales(model, plan.matmuls, plan.calibration.scales, changes, node_names)
        sequential = plan.method.sequential and self._runs_partly_encoded(model)
        waves = matmul_waves(model, plan.matmuls) if sequential else [plan.matmuls]
        encoded = Encoded(waves=len(waves) if sequential else 0)
        for wave in self._fed(model, plan, waves, ctx.seed):
            for m in wave.matmuls:
                self._encode(model, plan, m, wave, changes, node_names, encoded)
        cfg = self.config
        others = quantize_other_weights(model, cfg.other_bits, cfg.block, changes, node_names) if cfg.other_bits else []
        changes.notes = self._notes(plan, encoded, folded, others)
        return changes

    def _matmuls(self, model: ir.Model, ctx: PassContext) -> list[WeightMatMul]:
        """The weight MatMuls to quantize: all but those `exclude` names."""
        found = require_weight_matmuls(model, self.name, ctx.graph)
        return [m for m in found if not matches_any(m.name, self.config.exclude)]

    def _fed(self, model: ir.Model, plan: Int4Plan, waves: list[list[WeightMatMul]], seed: int) -> Iterator[Wave]:
        """The waves in order, each after the first (only a sequential run has more) with its inputs captured from
        the graph as the earlier waves left it (wave 0's inputs depend on no weight MatMul: the float ones). Lazy: a
        wave's inputs are captured once the waves before it are encoded."""
        yield Wave(waves[0])
        for wave in waves[1:]:
            wanted = sorted({name_of(m.activation) for m in wave})  # as the graph now feeds them
            got = capture_values(model, wanted, plan.feeds)
            yield Wave(wave, live={k: subsample(v, seed, HESSIAN_MAX_TOKENS) for k, v in got.items()})

    def _encode(
        self,
        model: ir.Model,
        plan: Int4Plan,
        m: WeightMatMul,
        wave: Wave,
        changes: PassChanges,
        node_names: NodeNames,
        encoded: Encoded,
    ) -> None:
        """Write `m` in the weight format (or as a float (K, N) weight where kept at 32 bits) and drop what it
        replaced: its Transpose, its initializer, the mapping of an external weight."""
        cfg, transpose = self.config, m.transpose
        if m.name in plan.kept and cfg.keep_bits == 32:
            s = plan.scale_of(m)
            kn = m.kn() if s is None else m.kn() * s[:, None]
            m.node.replace_input_with(1, new_initializer(model.graph, kn, f"{m.name}.weight_kn"))
            encoded.counts["fp32"] += 1
        else:
            bits = cfg.keep_bits if m.name in plan.kept else 4
            qw = plan.quantize(m, bits, wave)
            encoded.float_zero_points += qw.float_zeros
            encoder = plan.method.format.encode_matmul
            assert encoder is not None  # Int4Config refuses a format that stores no weight MatMuls
            opts = {"accuracy_level": cfg.accuracy_level, "node_names": node_names}
            added, removed = encoder(model, m.node, qw, m.name, opts)
            changes.nodes_added += added
            changes.nodes_removed += removed  # MatMulNBits replaces the MatMul itself
            encoded.counts[f"int{bits}"] += 1
        changes.initializers_touched.append(m.weight_name)
        changes.nodes_removed += remove_if_unused(model, transpose)
        if m.weight.is_initializer() and not m.weight.uses():
            model.graph.initializers.pop(m.weight_name, None)
        if not m.weight.uses():  # replaced (remove_if_unused may already have dropped the initializer)
            release_weight(m.weight)

    def _notes(self, plan: Int4Plan, encoded: Encoded, folded: int, others: list[str]) -> dict:
        """The report's facts: what was written, the method's choices and the calibration they rest on."""
        cfg, fmt, cal = self.config, plan.method.format, plan.calibration
        chosen = cal.chosen
        return {
            "other_weights": others,
            "format": fmt.name,
            "encoding": fmt.report_label(4),
            "method": cfg.method,
            "matmuls": dict(encoded.counts),
            "float_zero_points": encoded.float_zero_points,
            "sequential_waves": encoded.waves,
            "retarget": plan.method.retarget if encoded.waves else None,  # the value that ran (config: None if unset)
            "kept": sorted(plan.kept),
            "sensitivity_top": {n: round(plan.sensitivity[n], 6) for n in plan.ranked[: max(cfg.mixed, 5)]},
            "awq_groups": len(cal.scales),
            "awq_dropped_for_gptq": len(cal.dropped),
            "awq_check_error_ratio": cal.check,
            "awq_folded_into_norm": folded,
            "calibration_tokens": {k: int(v.shape[0]) for k, v in plan.acts.items()} if plan.acts else {},
            "symmetric_chosen": {"symmetric": sum(chosen.values()), "asymmetric": len(chosen) - sum(chosen.values())}
            if chosen
            else {},
        }

    def _runs_partly_encoded(self, model: ir.Model) -> bool:
        """Whether ONNX Runtime can run the graph with some MatMuls already encoded, as the sequential capture
        does: a format's own opset (MatMulNBits: none; blocked DequantizeLinear: 21, which `edgekit optimize`
        raises to first, `min_opset`); a graph handed to the pass below it is quantized from float inputs."""
        needs = self.format.min_opset
        return needs is None or model.opset_imports.get("", 0) >= needs
