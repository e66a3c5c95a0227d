"""The INT4 pass's settings: its tuned constants (each says where it was measured) and the typed `Int4Config` a
recipe or `--pass int4:...` fills, with the checks that refuse a combination a weight format or method cannot
take (the format's own constraints are in `weight_formats.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from edgekit.errors import ConfigError
from edgekit.names import DECODER, VISION_ENCODER

from .config import PassConfig, param
from .weight_formats import WeightFormat, WritesWeightFormat

AWQ_MAX_TOKENS = 512  # tokens the alpha search multiplies through (the Hessians use up to HESSIAN_MAX_TOKENS)
HESSIAN_MAX_TOKENS = 8192
# awq-gptq drops an input's AWQ scale only when GPTQ's held-out error with it is this much higher: the held-out
# quarter of the calibration tokens is small, and on the default model every ratio fell within 0.94-1.10
AWQ_CHECK_MARGIN = 1.15
# GPTQ fits H = X^T X from the calibration tokens; with few tokens per input channel it fits the calibration set's
# own directions and rounds worse on new inputs. Shrinking H towards its diagonal by K / tokens times this (each
# channel by its own energy, so outlier channels do not swamp the rest as a mean-diagonal damping would) moves
# GPTQ towards RTN with the activation-weighted scale search as the estimate gets noisier.
SHRINK_PER_CHANNEL_PER_TOKEN = 0.5
# sequential GPTQ takes the isotropic gain of each input's least-squares target in full and this share of each
# row's James-Stein-corrected rest (int4_sequential.retarget_weight); chosen on the tuning models the bench does not
# score, at the default calibration budget (the lowest mean ratio to ORT's best of 0.5, 0.7, 0.85 and 1 at 128
# feeds; level with 0.5 at 64: docs/passes-int4.md)
RETARGET = 0.7
# Generated calibration samples when none are given: the sample count of GPTQ's paper and the default of AutoAWQ
# (max_calib_samples) and NNCF (subset_size). At 64 x 32 tokens the sequential target is noise-limited (the tuning
# models' mean ratio to ORT's best 0.758 at 64, 0.737 at 128 with retarget 0.5, 0.722 with 0.7; for 1.1-1.6x the
# pass's time: docs/passes-int4.md).
CALIB_SAMPLES = 128
METHODS = ("rtn", "hqq", "awq", "gptq", "awq-gptq")
GPTQ_METHODS = ("gptq", "awq-gptq")
GRAPHS = {"decoder": DECODER, "vision": VISION_ENCODER}  # the `graphs` parameter's names for the files


@dataclass
class Int4Config(WritesWeightFormat, PassConfig):
    block: int = param(32, choices=(16, 32, 64, 128), help="block size along K")
    symmetric: bool | None = param(
        None,
        help="symmetric (no zero points; required by qdq-blocked) or asymmetric; unset: symmetric where the format "
        "takes no zero points, else per MatMul by held-out calibration error with gptq/awq-gptq (asymmetric with "
        "the others)",
    )
    method: str = param(
        "awq-gptq",
        choices=METHODS,
        help="rtn: round to nearest; hqq: data-free l_p refinement of the scales; awq: activation-aware scaling "
        "with an output-error clipping search; gptq: error-compensating rounding (Hessian of calibration "
        "activations); awq-gptq (default): GPTQ, with AWQ's scaling for each input where it lowers the "
        "error on held-out calibration tokens",
    )
    float_zeros: bool | None = param(
        None,
        help="asymmetric MatMuls: float zero points (matmulnbits takes them, as ORT's HQQ writes them), with "
        "GPTQ's block scales and offsets refitted by least squares; unset: on with gptq/awq-gptq where the "
        "format takes them",
    )
    sequential: bool | None = param(
        None,
        help="gptq/awq-gptq: quantize in topological waves, each fitted on its inputs from the model with the "
        "earlier waves quantized, against the float model's outputs (GPTAQ; one calibration run per wave); "
        "unset: on for gptq/awq-gptq",
    )
    retarget: float | None = param(
        None,
        min=0.0,
        max=1.0,
        help="sequential: the least-squares target W X X_q^T (X_q X_q^T)^-1 fits the float output from the "
        "quantized inputs; its isotropic gain is always taken, and this share of each row's rest, scaled by its "
        f"James-Stein factor against the calibration noise (0: the gain alone); unset: {RETARGET}",
    )
    code_sweeps: int = param(
        1,
        min=0,
        max=10,
        help="gptq: coordinate-descent sweeps over the codes after the sweep (each code one step where the "
        "output error falls); 1 since sequential: 1-4 percent lower error on the LLaVA tuning decoders, level "
        "on the default model's decoder (docs/passes-int4.md)",
    )
    format: str | None = param(
        None,
        help="weight format (edgekit/passes/weight_formats.py): matmulnbits (ONNX Runtime's MatMulNBits), "
        "qdq-blocked (symmetric blocked DequantizeLinear, opset 21: TensorRT, X1), or one a target registers; "
        "unset: the build target's first that fits, else matmulnbits",
    )
    target: str | None = param(
        None,
        help="deprecated: the format this target takes (target=cpu: matmulnbits; orin/x1: qdq-blocked); use format",
    )
    clip: int = param(
        0, min=0, max=50, help="range-shrink search steps per block (0: none for rtn/hqq; the data methods use 10)"
    )
    scale_search: bool = param(
        True,
        help="symmetric: ORT's scale, abs-max/-8 with the abs-max's sign (positive-only where the format takes no "
        "negative scales, as qdq-blocked), and with "
        "calibration data also max/7 and max/7.5, chosen by output error (false: max/7 only, edgekit <= 0.9)",
    )
    refine: int = param(0, min=0, max=20, help="least-squares scale re-estimation steps after rounding (rtn/awq)")
    awq_check: bool = param(
        True,
        help="awq-gptq: drop AWQ's scale for an input where GPTQ's held-out calibration error is clearly higher",
    )
    damp: float = param(0.01, min=0.0, max=10.0, help="gptq: damping, as a fraction of the Hessian's mean diagonal")
    shrink: float | None = param(
        None,
        min=0.0,
        max=100.0,
        help="gptq: add this fraction of each channel's own Hessian diagonal; unset: "
        f"{SHRINK_PER_CHANNEL_PER_TOKEN} x K / calibration tokens (more when the calibration set is small)",
    )
    accuracy_level: int = param(0, choices=(0, 1, 2, 3, 4), help="MatMulNBits accuracy_level (matmulnbits only)")
    mixed: int = param(0, min=0, max=1000, help="keep the N most sensitive MatMuls at keep_bits")
    keep: list[str] = param([], help="module-name patterns always kept at keep_bits (e.g. lm_head)")
    keep_bits: int = param(8, choices=(8, 32), help="precision of kept MatMuls (8 or 32 = float)")
    exclude: list[str] = param([], help="module-name patterns left untouched")
    calib: int = param(
        CALIB_SAMPLES,
        min=1,
        max=4096,
        help="calibration samples generated when none are given (GPTQ wants tokens >> K; 128 as GPTQ, AutoAWQ, NNCF)",
    )
    seq: int = param(32, min=1, max=4096, help="tokens per generated calibration sample")
    awq_grid: int = param(10, min=1, max=100, help="alpha grid points in [0, 1] for awq")
    graphs: list[str] = param(
        ["decoder"], choices=tuple(GRAPHS), help="graphs whose weight MatMuls are quantized (decoder;vision)"
    )
    fit_block: bool = param(
        False,
        help="use the largest block <= block that divides each K (e.g. 128 where K "
        "allows, 64 for K=192) instead of refusing a K it does not divide",
    )
    other_bits: int = param(
        0,
        choices=(0, 4, 8),
        help="also store other large float weights (a patch Conv, a position table) at these "
        "bits as blocked DequantizeLinear; 0 leaves them float",
    )

    def validate(self, where: str) -> None:
        if not self.graphs:
            raise ConfigError(f"{where}.graphs: name at least one of {', '.join(GRAPHS)}")
        if self.sequential and self.method not in GPTQ_METHODS:
            raise ConfigError(f"{where}.sequential: only gptq and awq-gptq quantize sequentially")
        if self.retarget is not None and (self.sequential is False or self.method not in GPTQ_METHODS):
            raise ConfigError(f"{where}.retarget: only sequential gptq / awq-gptq retarget (it would be ignored here)")
        if self.method == "hqq" and self.float_zeros:
            raise ConfigError(f"{where}.float_zeros: method hqq keeps integer zero points; use gptq, awq or rtn")
        self.check_format(where)

    def block_for(self, k: int) -> int:
        """`block`, or with `fit_block` the largest allowed block <= it that divides K (checked by the caller)."""
        if self.fit_block:
            for b in (128, 64, 32, 16):
                if b <= self.block and k % b == 0:
                    return b
        return self.block

    def shrink_for(self, k: int, tokens: int) -> float:
        """GPTQ's shrinkage towards the diagonal for an input of K channels seen on `tokens` calibration tokens."""
        if self.shrink is not None:
            return self.shrink
        return SHRINK_PER_CHANNEL_PER_TOKEN * k / max(tokens, 1)

    def format_bits(self) -> set[int]:
        """4, and 8 where `mixed` or `keep` keep MatMuls at 8 bits (32 leaves them float)."""
        kept = (self.mixed > 0 or bool(self.keep)) and self.keep_bits == 8
        return {4, 8} if kept else {4}

    def format_refusal(self, fmt: WeightFormat) -> str | None:
        if self.symmetric is False and not fmt.zero_points:
            return f"symmetric: format {fmt.name} takes symmetric weights only (no zero points)"
        if self.float_zeros and not fmt.float_zero_points:
            return f"float_zeros: format {fmt.name} takes no float zero points"
        return super().format_refusal(fmt)

    def also_writes(self) -> dict[str, str]:
        """`other_bits` writes the other large weights as blocked DequantizeLinear, whatever `format` is."""
        return {"other_bits": "qdq-blocked"} if self.other_bits else {}
