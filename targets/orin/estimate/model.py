"""What is being run: the model (the core's `ModelDescription`: a LLaMA-style decoder with an optional vision
tower), the formats its weights are held in, and one report's token counts.

Why together: these three are the estimate's whole input besides the device; a bundle is read into them
(`bundle.py`), a preset or `shape_from_params` makes a model without one. The models known by name are the
core's (`edgekit.describe_model.PRESETS`) and the seed's 1.2B VLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgekit.describe_model import PRESETS as KNOWN_MODELS
from edgekit.errors import ConfigError
from edgekit.model_description import ModelDescription, VisionDescription, check_positive_int

WEIGHT_DTYPES = ("fp32", "fp16", "int8", "int4")
COMPUTE_DTYPES = ("fp32", "fp16", "int8")
_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
KV_BYTES = 2.0  # the engine keeps K and V in FP16
SCALE_BYTES = 2.0  # one FP16 scale per block of a blocked INT4/INT8 weight


# SigLIP-B/16 at 256 px: 256 image tokens, ~86M parameters (the usual vision tower of a ~1B VLM)
SIGLIP_B16_256 = VisionDescription(image_size=256, patch_size=16, hidden=768, layers=12, mlp=3072)


def shape_from_params(
    params: float,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int = 32000,
    head_dim: int | None = None,
    tied_embeddings: bool = False,
    vision: VisionDescription | None = SIGLIP_B16_256,
    name: str | None = None,
) -> ModelDescription:
    """A shape for a model known by its size: the MLP width is solved so the parameters add up to `params`
    (vision tower and embeddings included), so a 1.2B model can be estimated without a bundle."""
    hd = head_dim or hidden // heads
    probe = ModelDescription("probe", hidden, layers, heads, kv_heads, hd, 1, vocab, tied_embeddings, vision)
    rest = params - probe.lm_head_params() - probe.embedding_params() - probe.vision_params()
    attn = layers * (2 * hidden * heads * hd + 2 * hidden * kv_heads * hd)
    intermediate = int(round((rest - attn) / (3 * hidden * layers)))
    if intermediate < 1:
        raise ConfigError(
            f"model shape field 'params': {params:.3g} is too small for {layers} layers of width {hidden} "
            "with this vocabulary and vision tower"
        )
    label = name or f"{params / 1e9:.3g}b"
    return ModelDescription(label, hidden, layers, heads, kv_heads, hd, intermediate, vocab, tied_embeddings, vision)


def _seed_shape() -> ModelDescription:
    # The seed names only "a 1.2B medical VLM". Assumed: a TinyLlama-1.1B-shaped decoder with a SigLIP-B/16 tower
    # and a LLaVA-style 2-layer connector: 1.19B parameters, 256 image tokens.
    return ModelDescription("seed-1.2b", 2048, 22, 32, 4, 64, 5632, 32000, False, SIGLIP_B16_256)


PRESETS = {"seed-1.2b": _seed_shape, **KNOWN_MODELS}  # the seed's model, then the core's named models


def preset(name: str) -> ModelDescription:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}' (known: {', '.join(PRESETS)})")
    return PRESETS[name]()


@dataclass(frozen=True)
class Precision:
    """Weight formats as the engine holds them. Weight-only INT4/INT8 computes in FP16; FP32 weights compute on
    CUDA cores; `compute="int8"` is W8A8 (INT8 activations too)."""

    weights: str = "fp16"  # the decoder's matmuls
    lm_head: str | None = None  # default: as `weights`
    vision: str | None = None  # default: as `weights`
    embedding: str = "fp16"
    block: int = 32  # block of a blocked INT4/INT8 weight (one FP16 scale each)
    compute: str | None = None  # default: fp32 for fp32 weights, else fp16
    sparse24: bool = False
    head_keep: float = 1.0  # share of attention heads left after head pruning

    def __post_init__(self) -> None:
        for name in ("weights", "lm_head", "vision", "embedding"):
            v = getattr(self, name)
            if v is not None and v not in WEIGHT_DTYPES:
                raise ConfigError(f"field '{name}' = {v!r} (expected one of {', '.join(WEIGHT_DTYPES)})")
        if self.compute is not None and self.compute not in COMPUTE_DTYPES:
            raise ConfigError(f"field 'compute' = {self.compute!r} (expected one of {', '.join(COMPUTE_DTYPES)})")
        check_positive_int("block", self.block)
        if not 0.0 < self.head_keep <= 1.0:
            raise ConfigError(f"field 'head_keep' = {self.head_keep!r} (expected 0 < keep <= 1)")

    @property
    def compute_dtype(self) -> str:
        return self.compute or ("fp32" if self.weights == "fp32" else "fp16")

    def bytes_per_weight(self, dtype: str, sparse_fraction: float = 1.0) -> float:
        scales = SCALE_BYTES / self.block if dtype in ("int4", "int8") else 0.0
        if self.sparse24 and dtype in ("fp16", "int8"):
            return _BYTES[dtype] * sparse_fraction + scales
        return _BYTES[dtype] + scales

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(lm_head=self.lm_head or self.weights, vision=self.vision or self.weights, compute=self.compute_dtype)
        return d


@dataclass(frozen=True)
class ReportTokens:
    """The workload of one report: text prompt tokens and generated tokens (image tokens come from the shape)."""

    prompt_tokens: int = 32
    new_tokens: int = 96

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 0:
            raise ConfigError(f"field 'prompt_tokens' = {self.prompt_tokens!r} (expected an integer >= 0)")
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 1:
            raise ConfigError(f"field 'new_tokens' = {self.new_tokens!r} (expected an integer >= 1)")
