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

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.onnx_model import NodeNames

from .base import GraphPass, PassChanges, PassContext
from .calibration import capture_values
from .gptq import block_hessians, gptq_quantize, hessian
from .hqq import hqq_quantize
from .int4_config import (
    AWQ_CHECK_MARGIN,
    AWQ_MAX_TOKENS,
    CALIB_SAMPLES,
    DATA_METHODS,
    GPTQ_METHODS,
    GRAPHS,
    HESSIAN_MAX_TOKENS,
    METHODS,
    RETARGET,
    SHRINK_PER_CHANNEL_PER_TOKEN,
    Int4Config,
)
from .int4_encode import QuantizedWeight, check_block, quantize_blocks
from .int4_graph import (
    calibration_feeds,
    held_out,
    new_initializer,
    norm_weight,
    quantize_other_weights,
    release_weight,
    subsample,
)
from .int4_sequential import InputFit, input_fit, matmul_waves, retarget_weight
from .patterns import WeightMatMul, matches_any, remove_if_unused, require_weight_matmuls
from .weight_formats import WeightFormat

__all__ = ["CALIB_SAMPLES", "METHODS", "RETARGET", "Int4Config", "Int4Pass", "quantize_other_weights"]


class Int4Pass(GraphPass):
    name = "int4"
    Config = Int4Config
    graphs = tuple(GRAPHS.values())  # the ones it can run on; `config.graphs` picks among them

    def applies_to(self, graph: str) -> bool:
        return graph in {GRAPHS[g] for g in self.config.graphs}

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        mms = [
            m
            for m in require_weight_matmuls(model, self.name, ctx.graph)
            if not matches_any(m.name, self.config.exclude)
        ]
        if not mms:
            raise ConfigError("int4.exclude: every weight MatMul is excluded, nothing to quantize")
        for m in mms:  # refuse before touching anything
            check_block(m.k, self.block_for(m.k), m.weight.name)

    @property
    def format(self) -> WeightFormat:
        """The weight format this pass writes (`format`, or what the deprecated `target` or no choice means)."""
        return self.config.weight_format()

    def min_opset(self) -> int | None:
        """The default-domain opset the result needs: the format's (qdq-blocked: 21; MatMulNBits is a
        com.microsoft op and needs none), and 21 for `other_bits` (blocked DequantizeLinear)."""
        needs = [n for n in (self.format.min_opset, 21 if self.config.other_bits else None) if n is not None]
        return max(needs) if needs else None

    def shrink_for(self, k: int, tokens: int) -> float:
        """GPTQ's shrinkage towards the diagonal for an input of K channels seen on `tokens` calibration tokens."""
        if self.config.shrink is not None:
            return self.config.shrink
        return SHRINK_PER_CHANNEL_PER_TOKEN * k / max(tokens, 1)

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
        return self.format.float_zero_points and self.config.method in GPTQ_METHODS

    @property
    def sequential(self) -> bool:
        """On for the GPTQ methods unless set false (validate refuses it for the others)."""
        return self.config.method in GPTQ_METHODS and self.config.sequential is not False

    @property
    def retarget(self) -> float:
        """`retarget` as set, or RETARGET (validate refuses it where nothing is sequential)."""
        return RETARGET if self.config.retarget is None else self.config.retarget

    def block_for(self, k: int) -> int:
        """`block`, or with `fit_block` the largest allowed block <= it that divides K (checked by the caller)."""
        if self.config.fit_block:
            for b in (128, 64, 32, 16):
                if b <= self.config.block and k % b == 0:
                    return b
        return self.config.block

    # ---------------------------------------------------------------------------------------------------------
    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        cfg = self.config
        fmt = self.format
        mms = [m for m in require_weight_matmuls(model, self.name, ctx.graph) if not matches_any(m.name, cfg.exclude)]
        needs_data = cfg.method in DATA_METHODS or cfg.mixed > 0
        acts: dict[str, np.ndarray] = {}
        feeds: list[dict[str, np.ndarray]] = []
        if needs_data:
            feeds = ctx.feeds() or calibration_feeds(model, ctx, cfg)
            names = sorted({m.activation.name for m in mms})
            acts = {
                k: subsample(v, ctx.seed, HESSIAN_MAX_TOKENS) for k, v in capture_values(model, names, feeds).items()
            }

        # a format with zero points, `symmetric` unset and a GPTQ method: each MatMul takes the symmetry with the
        # lower held-out error, chosen first, so that AWQ's scale search and its check below fit the grid each
        # MatMul will get (before, both ran asymmetric and a MatMul then quantized symmetric kept a scale fitted
        # for the other grid)
        choose_symmetry = cfg.symmetric is None and fmt.zero_points and cfg.method in GPTQ_METHODS
        chosen: dict[str, bool] = {}
        if choose_symmetry:
            for m in mms:
                if m.activation.name in acts:
                    w, x = m.kn().T, acts[m.activation.name]
                    chosen[m.name] = self._symmetric_fits_better(w, x, self.block_for(m.k), ctx.seed)

        def symmetric_of(m: WeightMatMul) -> bool:
            return chosen.get(m.name, self.symmetric)

        scales = self._awq_scales(mms, acts, ctx.seed, symmetric_of) if cfg.method in ("awq", "awq-gptq") else {}
        awq_dropped, awq_check = [], {}
        if cfg.method == "awq-gptq" and cfg.awq_check:
            for act_name in list(scales):
                members = [m for m in mms if m.activation.name == act_name]
                ratio = self._scaled_gptq_error_ratio(members, acts[act_name], scales[act_name], ctx.seed, symmetric_of)
                awq_check[members[0].name] = round(ratio, 4)
                if ratio >= AWQ_CHECK_MARGIN:
                    awq_dropped.append(act_name)
                    del scales[act_name]
        # Weights are read per MatMul when quantized and released after (see `release_weight`), never all at once:
        # with external data this keeps the pass at about one float weight in memory, whatever the model size.
        act_of = {id(m): m.activation.name for m in mms}  # fixed now: applying scales re-points activations
        clip = cfg.clip or (10 if cfg.method in DATA_METHODS else 0)
        signed = fmt.signed_scales  # MatMulNBits takes negative scales; TensorRT's DequantizeLinear does not
        hessians: dict[str, np.ndarray] = {}
        fits: dict[str, InputFit] = {}  # sequential: the current wave's, per input

        def act_hessian(name: str) -> np.ndarray:
            if name not in hessians:
                hessians[name] = hessian(acts[name])
            return hessians[name]

        def quantize(m: WeightMatMul, bits: int, live: np.ndarray | None = None) -> QuantizedWeight:
            """`live`: the MatMul's input captured from the partly quantized model (sequential), as the graph
            now computes it (x / s where AWQ's scale is applied)."""
            act = act_of[id(m)]
            s = scales.get(act)
            w = m.kn().T  # (N, K)
            block = self.block_for(m.k)
            common = {"bits": bits, "symmetric": symmetric_of(m), "name": m.weight.name}
            fz = {} if cfg.method == "hqq" else {"float_zeros": self.float_zeros and bits == 4}
            h = None
            if live is not None:  # GPTAQ: fit the float output from the quantized inputs
                if act not in fits:  # once per input of the wave (q/k/v, gate/up share theirs, and its K)
                    ridge = self.shrink_for(m.k, acts[act].shape[0])
                    xq = live if s is None else live * s[None, :]
                    fits[act] = input_fit(acts[act], xq, ridge=ridge, damp=cfg.damp)
                w = retarget_weight(w, fits[act], beta=self.retarget)
                h = fits[act].hq
            elif act in acts and cfg.method in DATA_METHODS:
                h = act_hessian(act)
            if s is not None:  # the weight times s, the Hessian of x / s
                w = w * s[None, :]
                h = None if h is None else h / np.outer(s, s)
            if cfg.method in GPTQ_METHODS:
                return self._gptq(w, h, block, **common, tokens=acts[act].shape[0])
            if cfg.method == "hqq":
                return hqq_quantize(w, block, signed_scales=signed, **common)
            return quantize_blocks(
                w,
                block,
                hessian=None if h is None else block_hessians(h, block),
                clip_grid=clip,
                scale_search=cfg.scale_search,
                signed_scales=signed,
                refine=cfg.refine,
                **common,
                **fz,
            )

        sensitivity = self._sensitivity(mms, acts, quantize, scales) if cfg.mixed > 0 else {}
        ranked = sorted(sensitivity, key=sensitivity.get, reverse=True)
        kept = set(ranked[: cfg.mixed]) | {m.name for m in mms if matches_any(m.name, cfg.keep)}

        changes = PassChanges()
        node_names = NodeNames(model.graph)
        folded = self._apply_scales(model, mms, scales, changes, node_names)
        encoder = fmt.encode_matmul
        assert encoder is not None  # Int4Config refuses a format that stores no weight MatMuls
        opts = {"accuracy_level": cfg.accuracy_level, "node_names": node_names}
        counts = defaultdict(int)
        float_zero_points = 0  # MatMulNBits with float zero points: 32 bits per block instead of 4
        sequential = self.sequential and self._runs_partly_encoded(model)
        waves = matmul_waves(model, mms) if sequential else [mms]
        live: dict[str, np.ndarray] = {}
        for index, wave in enumerate(waves):
            if sequential and index > 0:  # wave 0's inputs depend on no weight MatMul: the float ones
                wanted = sorted({m.activation.name for m in wave})  # as the graph now feeds them
                got = capture_values(model, wanted, feeds)
                live = {k: subsample(v, ctx.seed, HESSIAN_MAX_TOKENS) for k, v in got.items()}
                fits.clear()
            for m in wave:
                transpose = m.transpose
                if m.name in kept and cfg.keep_bits == 32:
                    s = scales.get(act_of[id(m)])
                    kn = m.kn() if s is None else m.kn() * s[:, None]
                    value = new_initializer(model.graph, kn, f"{m.name}.weight_kn")
                    m.node.replace_input_with(1, value)
                    counts["fp32"] += 1
                else:
                    bits = cfg.keep_bits if m.name in kept else 4
                    qw = quantize(m, bits, live.get(m.activation.name))
                    float_zero_points += qw.float_zeros
                    added, removed = encoder(model, m.node, qw, m.name, opts)
                    changes.nodes_added += added
                    changes.nodes_removed += removed  # MatMulNBits replaces the MatMul itself
                    counts[f"int{bits}"] += 1
                changes.initializers_touched.append(m.weight.name)
                changes.nodes_removed += remove_if_unused(model, transpose)
                if m.weight.is_initializer() and not m.weight.uses():
                    model.graph.initializers.pop(m.weight.name, None)
                if not m.weight.uses():  # replaced (remove_if_unused may already have dropped the initializer)
                    release_weight(m.weight)
        others = quantize_other_weights(model, cfg.other_bits, cfg.block, changes, node_names) if cfg.other_bits else []
        changes.notes = {
            "other_weights": others,
            "format": fmt.name,
            "encoding": fmt.report_label(4),
            "method": cfg.method,
            "matmuls": dict(counts),
            "float_zero_points": float_zero_points,
            "sequential_waves": len(waves) if sequential else 0,
            "retarget": self.retarget if sequential else None,  # the value that ran (the config says None if unset)
            "kept": sorted(kept),
            "sensitivity_top": {n: round(sensitivity[n], 6) for n in ranked[: max(cfg.mixed, 5)]},
            "awq_groups": len(scales),
            "awq_dropped_for_gptq": len(awq_dropped),
            "awq_check_error_ratio": awq_check,
            "awq_folded_into_norm": folded,
            "calibration_tokens": {k: int(v.shape[0]) for k, v in acts.items()} if acts else {},
            "symmetric_chosen": {"symmetric": sum(chosen.values()), "asymmetric": len(chosen) - sum(chosen.values())}
            if chosen
            else {},
        }
        return changes

    def _runs_partly_encoded(self, model: ir.Model) -> bool:
        """Whether ONNX Runtime can run the graph with some MatMuls already encoded, as the sequential capture
        does: a format's own opset (MatMulNBits: none; blocked DequantizeLinear: 21, which `edgekit optimize`
        raises to first, `min_opset`); a graph handed to the pass below it is quantized from float inputs."""
        needs = self.format.min_opset
        return needs is None or model.opset_imports.get("", 0) >= needs

    # ---------------------------------------------------------------------------------------------------------
    def _awq_scales(
        self, mms: list[WeightMatMul], acts: dict[str, np.ndarray], seed: int, symmetric_of
    ) -> dict[str, np.ndarray]:
        """Per activation (shared by a group of MatMuls): s = mean|x|^alpha, alpha chosen on output error, each
        MatMul on the grid it will be quantized on (`symmetric_of`). A channel that is zero on every calibration
        token keeps s = 1 and the scale is normalised over the others: mean|x| says nothing about it, and the
        1e-8 floor made its s tiny (0.04 on the bench's MLP at 32 tokens), so its rounding error came back
        divided by it off the calibration set; with float zero points, which have no exact 0, that made
        asymmetric awq-gptq 1.4x RTN's output error (0.25 against 0.18; 0.069 with s = 1)."""
        cfg = self.config
        groups: dict[str, list[WeightMatMul]] = defaultdict(list)
        for m in mms:
            groups[m.activation.name].append(m)
        out = {}
        for act_name, members in groups.items():
            x = subsample(acts[act_name], seed, AWQ_MAX_TOKENS)
            mean_abs = np.abs(x).mean(0)
            live = mean_abs > 0  # the rest were never seen: left unscaled
            if not live.any():
                continue
            mean_abs = mean_abs + 1e-8
            ref = [x @ m.kn() for m in members]
            best, best_err = None, np.inf
            for alpha in np.linspace(0.0, 1.0, cfg.awq_grid + 1):
                s = np.ones(mean_abs.shape)  # float64, as mean_abs ** alpha is
                s[live] = mean_abs[live] ** alpha
                s[live] /= np.sqrt(s[live].max() * s[live].min())
                err = 0.0
                for m, y in zip(members, ref):
                    qw = quantize_blocks(
                        m.kn().T * s[None, :],
                        self.block_for(m.k),
                        symmetric=symmetric_of(m),
                        scale_search=False,  # a proxy: the final quantizer searches
                        signed_scales=self.format.signed_scales,
                        name=m.weight.name,
                    )
                    err += float(((x @ (qw.dequantize().T / s[:, None]) - y) ** 2).mean())
                if err < best_err:
                    best, best_err = s, err
            if best is not None and not np.allclose(best, 1.0):
                out[act_name] = best.astype(np.float32)
        return out

    def _scaled_gptq_error_ratio(
        self, members: list[WeightMatMul], x: np.ndarray, s: np.ndarray, seed: int, symmetric_of
    ) -> float:
        """Output error of GPTQ of this input's MatMuls with AWQ's scale over that without, fitted on three
        quarters of the calibration tokens and measured on the rest. Why: the scale is chosen on RTN's
        error, and GPTQ, which already compensates along the input channels, sometimes does better without."""
        fit, val = held_out(x, seed)
        if val.shape[0] == 0:
            return 0.0
        h = hessian(fit)
        err = {False: 0.0, True: 0.0}
        for m in members:
            w = m.kn().T
            y = val @ w.T
            for scaled in (False, True):
                qw = self._gptq(
                    w * s[None, :] if scaled else w,
                    h / np.outer(s, s) if scaled else h,
                    self.block_for(m.k),
                    symmetric=symmetric_of(m),
                    tokens=fit.shape[0],
                    name=m.weight.name,
                    check=True,
                )
                wq = qw.dequantize() / s[None, :] if scaled else qw.dequantize()
                err[scaled] += float(((val @ wq.T - y) ** 2).sum())
        return err[True] / max(err[False], 1e-30)

    def _symmetric_fits_better(self, w: np.ndarray, x: np.ndarray, block: int, seed: int) -> bool:
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
            qw = self._gptq(w, h, block, symmetric=symmetric, tokens=fit.shape[0], check=True)
            err[symmetric] = float(((val @ qw.dequantize().T - y) ** 2).sum())
        return err[True] <= err[False]

    def _gptq(
        self,
        w: np.ndarray,
        h: np.ndarray,
        block: int,
        *,
        symmetric: bool,
        tokens: int,
        bits: int = 4,
        name="weight",
        check: bool = False,
    ) -> QuantizedWeight:
        """GPTQ of `w` (N, K) with this pass's settings, shrunk for a Hessian fitted on `tokens` tokens: the same
        quantizer for the MatMuls and for the held-out checks that choose their symmetry and AWQ scales, except
        that a `check` skips the code sweeps (each one costs about a GPTQ, and the checks run GPTQ four times
        per MatMul)."""
        cfg = self.config
        return gptq_quantize(
            w,
            h,
            block,
            bits=bits,
            symmetric=symmetric,
            damp=cfg.damp,
            shrink=self.shrink_for(w.shape[1], tokens),
            clip_grid=cfg.clip or 10,
            scale_search=cfg.scale_search,
            signed_scales=self.format.signed_scales,  # MatMulNBits takes negative scales; TRT's DequantizeLinear not
            float_zeros=self.float_zeros and bits == 4,
            code_sweeps=0 if check else cfg.code_sweeps,
            name=name,
        )

    def _sensitivity(self, mms, acts, quantize, scales) -> dict[str, float]:
        """Relative output error of each MatMul quantized alone (on its own calibration activations)."""
        out = {}
        for m in mms:
            x = acts[m.activation.name]
            y = x @ m.kn()
            s = scales.get(m.activation.name)
            wq = quantize(m, 4).dequantize().T
            if s is not None:
                wq = wq / s[:, None]
            out[m.name] = float(np.linalg.norm(x @ wq - y) / (np.linalg.norm(y) + 1e-12))
        return out

    def _apply_scales(self, model: ir.Model, mms, scales, changes: PassChanges, node_names: NodeNames) -> int:
        """x -> x / s in front of each scaled group: folded into a norm's weight when that Mul is theirs alone."""
        folded = 0
        for act_name, s in scales.items():
            members = [m for m in mms if m.activation.name == act_name]
            act = members[0].activation
            producer = act.producer()
            gamma = norm_weight(producer, act, s.shape[0])
            if gamma is not None:
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
