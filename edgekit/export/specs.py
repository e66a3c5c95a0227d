"""What the graph builders need to know about an architecture: its shape, held, and how to build it.

Why a spec holds a description instead of copying it: a model's shape (layers, heads, widths, vocabulary) is
described once, as the cost models read it (`edgekit.model_description`); the specs hold that description and add
only what the graph needs besides (norm epsilons, rotary tables, biases, weight names). Their size attributes are
the description's, read through. `from_model_config` builds radreport-tiny's over its `ModelDescription`; a Hugging
Face import (`edgekit.hf.config.decoder_spec`) builds a decoder's over the shape its config's one reader gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgekit.decoder_shape import DecoderShape
from edgekit.errors import ConfigError
from edgekit.export.model_config import ModelConfig
from edgekit.model_description import ModelDescription, VisionDescription, from_model_config


@dataclass(frozen=True)
class DecoderSpec:
    """A LLaMA-style decoder: RMSNorm, RoPE (HF non-interleaved), GQA attention, SwiGLU MLP, over `shape`."""

    shape: DecoderShape  # the sizes (a ModelDescription where the whole model was described)
    rms_eps: float
    rope_theta: float
    qkv_bias: bool = False  # Qwen2 has q/k/v biases, LLaMA none
    layer_prefix: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"  # "model.embed_tokens" for tied embeddings
    # Rotary inverse frequencies when a rope scaling (linear, llama3) changes them; None: theta^(-2i/head_dim)
    rope_inv_freq: tuple[float, ...] | None = None
    # Qwen2-VL's M-RoPE: the rotary frequencies split among (temporal, height, width) position axes, so
    # position_ids is (3, batch, seq); None: one position per token, (batch, seq)
    mrope_section: tuple[int, ...] | None = None

    @property
    def hidden(self) -> int:
        return self.shape.hidden

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def heads(self) -> int:
        return self.shape.heads

    @property
    def kv_heads(self) -> int:
        return self.shape.kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def intermediate(self) -> int:
        return self.shape.intermediate

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab

    @classmethod
    def from_model_config(cls, c: ModelConfig) -> DecoderSpec:
        return cls(from_model_config(c), rms_eps=c.rms_eps, rope_theta=c.rope_theta)


@dataclass(frozen=True)
class VisionSpec:
    """A ViT/SigLIP-style encoder run per frame, then radreport's temporal + spatial pooling and connector, over
    `model`: its vision part is the encoder's sizes, its decoder width the connector's output. The attention heads
    are the spec's own (the description counts weights and FLOPs, which the heads do not change)."""

    model: ModelDescription
    heads: int
    ln_eps: float
    gelu: str = "none"  # "tanh" for SigLIP's gelu_pytorch_tanh
    prefix: str = "vision_model"
    connector: str = "connector"
    temporal_std_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.model.vision is None:
            raise ConfigError(f"model {self.model.name!r} has no vision tower to build a vision encoder of")

    @property
    def vision(self) -> VisionDescription:
        assert self.model.vision is not None  # __post_init__ refused a model without one
        return self.model.vision

    @property
    def image_size(self) -> int:
        return self.vision.image_size

    @property
    def patch_size(self) -> int:
        return self.vision.patch_size

    @property
    def channels(self) -> int:
        return self.vision.channels

    @property
    def hidden(self) -> int:
        return self.vision.hidden

    @property
    def layers(self) -> int:
        return self.vision.layers

    @property
    def mlp(self) -> int:
        return self.vision.mlp

    @property
    def pool_stride(self) -> int:
        return self.vision.pool_stride

    @property
    def out_hidden(self) -> int:
        return self.model.hidden

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_image_tokens(self) -> int:
        return self.vision.image_tokens

    @classmethod
    def from_model_config(cls, c: ModelConfig) -> VisionSpec:
        return cls(from_model_config(c), heads=c.vision_heads, ln_eps=c.vision_ln_eps)
