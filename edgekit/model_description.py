"""One description of a model, made once per source and read by everything that budgets or serves it.

Why one: the decoder's shape, the vision tower, the image span and the position scheme used to be written five
times (the graph specs, the X1 cost model's presets, the Orin estimate's shapes with their own `vision_config`
reader, four vision types), and they drifted: the X1 model's `radreport-tiny` counted a 1024-token vocabulary
against the embedded model's 588. A source is described here once: edgekit's own `ModelConfig`
(`from_model_config`), a Hugging Face `config.json` through its family (`edgekit.hf.describe`), or a named
preset; `edgekit.describe_model` finds which from a name or a path. The X1 and Orin cost models read a
`ModelDescription`; the graph builders' specs (`edgekit.export.specs`) hold one (or its `DecoderShape`) and add
only how to build it (norm epsilons, rotary tables, weight names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgekit.decoder_shape import DecoderShape
from edgekit.errors import ConfigError
from edgekit.positions import MROPE, TEXT


def check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    """A shape field must be a whole number >= `minimum` (bools refused), else one line naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"model shape field '{name}' must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class VisionDescription:
    """A ViT run per frame (patch embedding, `layers` pre-norm blocks), pooled, then a 2-layer connector."""

    image_size: int
    patch_size: int
    hidden: int
    layers: int
    mlp: int
    channels: int = 3
    frames: int = 1
    pool_stride: int = 1  # spatial pooling of the patch grid before the connector
    connector_in: int = 0  # input width of the connector; 0: the encoder's width
    tiles: int = 1  # tower inputs per frame, each its own image tokens (Idefics3's split: rows x cols + global)
    extra_tokens: int = 0  # image tokens no tower input makes (LLaVA-NeXT's image_newline, one per feature row)

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "hidden", "layers", "mlp", "channels", "frames", "pool_stride"):
            check_positive_int(f"vision.{name}", getattr(self, name))
        check_positive_int("vision.tiles", self.tiles)

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        return self.tiles * (self.image_size // self.patch_size // self.pool_stride) ** 2 + self.extra_tokens

    def encoder_params(self) -> int:
        d, m = self.hidden, self.mlp
        return self.layers * (4 * d * d + 2 * d * m) + self.channels * self.patch_size**2 * d

    def connector_params(self, out_hidden: int) -> int:
        return (self.connector_in or self.hidden) * out_hidden + out_hidden * out_hidden

    def flops(self, out_hidden: int) -> float:
        """All frames through the encoder (GEMMs and attention), then the connector on the pooled tokens."""
        t, d = self.patches, self.hidden
        per_input = 2 * t * self.encoder_params() + self.layers * 4 * t * t * d
        return self.frames * self.tiles * per_input + 2 * self.image_tokens * self.connector_params(out_hidden)


@dataclass(frozen=True)
class ModelDescription(DecoderShape):
    """A LLaMA-style decoder (RMSNorm, RoPE, GQA, SwiGLU), an optional vision tower and connector, and how the
    decoder places positions (`text`, or Qwen2-VL's `mrope` over the image's grid). `family` names the source
    (`radreport-tiny`, a Hugging Face `model_type`, or `preset`)."""

    vision: VisionDescription | None = None
    family: str = "preset"
    positions: str = TEXT

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.positions not in (TEXT, MROPE):
            raise ConfigError(f"model shape field 'positions' must be '{TEXT}' or '{MROPE}', got {self.positions!r}")

    @classmethod
    def of(cls, shape: DecoderShape, **more: Any) -> ModelDescription:
        """`shape`'s decoder with the rest of a model (`vision`, `family`, `positions` in `more`)."""
        return cls(**{f.name: getattr(shape, f.name) for f in dataclasses.fields(DecoderShape)}, **more)

    @property
    def image_tokens(self) -> int:
        """Decoder positions one image takes (0: a text model)."""
        return self.vision.image_tokens if self.vision else 0

    def embedding_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def vision_params(self) -> int:
        return 0 if self.vision is None else self.vision.encoder_params() + self.vision.connector_params(self.hidden)

    def total_params(self) -> float:
        return self.decoder_params() + self.lm_head_params() + self.embedding_params() + self.vision_params()

    def kv_bytes_per_token(self, element_bytes: float = 2.0) -> float:
        """K and V of every layer for one token (FP16 by default, as the engines keep them)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["params"] = self.total_params()
        d["image_tokens"] = self.image_tokens
        return d


def from_model_config(config, name: str = "radreport-tiny") -> ModelDescription:
    """edgekit's own `ModelConfig` (edgekit/export/model_config.py): frames pooled by mean and std, so the
    connector takes twice the encoder's width."""
    c = config
    vision = VisionDescription(
        image_size=c.image_size,
        patch_size=c.patch_size,
        hidden=c.vision_hidden,
        layers=c.vision_layers,
        mlp=c.vision_mlp,
        channels=1,
        frames=c.num_frames,
        pool_stride=c.pool_stride,
        connector_in=2 * c.vision_hidden,
    )
    dims = (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.vocab_size)
    return ModelDescription(name, *dims, False, vision, "radreport-tiny")


# Decoders known by name (from their Hugging Face configs): the X1 cost model's calibration target, a small
# public LLM, and the decoders of NVIDIA's published Orin Nano tokens/s ([references] in orin's devices.toml)
QWEN2_7B = ModelDescription("qwen2-7b", 3584, 28, 28, 4, 128, 18944, 152064, False, family="qwen2")
SMOLLM2_135M = ModelDescription("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152, True, family="llama")
# The core's named decoders; `edgekit.describe_model.PRESETS` adds the embedded radreport-tiny (read from its
# shipped config through edgekit's own `ModelConfig`, which this module does not import: the graph specs hold a
# description, so `edgekit.export` imports this module)
PRESETS = {
    "qwen2-7b": lambda: QWEN2_7B,
    "smollm2-135m": lambda: SMOLLM2_135M,
    "llama-3.1-8b": lambda: ModelDescription(
        "llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, family="llama"
    ),
    "llama-3.2-3b": lambda: ModelDescription("llama-3.2-3b", 3072, 28, 24, 8, 128, 8192, 128256, True, family="llama"),
    "smollm2-1.7b": lambda: ModelDescription("smollm2-1.7b", 2048, 24, 32, 32, 64, 8192, 49152, True, family="llama"),
}
