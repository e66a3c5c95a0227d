"""What the graph builders need to know about an architecture: sizes in, weight names in.

The builders never read `ModelConfig` directly: a future Hugging Face import (LLaMA/Qwen2 decoders, ViT/SigLIP
encoders) fills these specs from its own config and reuses the same builders. `from_model_config` maps
radreport-tiny onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgekit.export.model_config import ModelConfig


@dataclass(frozen=True)
class DecoderSpec:
    """A LLaMA-style decoder: RMSNorm, RoPE (HF non-interleaved), GQA attention, SwiGLU MLP."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
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

    @classmethod
    def from_model_config(cls, c: ModelConfig) -> DecoderSpec:
        return cls(
            hidden=c.hidden,
            layers=c.layers,
            heads=c.heads,
            kv_heads=c.kv_heads,
            head_dim=c.head_dim,
            intermediate=c.intermediate,
            vocab_size=c.vocab_size,
            rms_eps=c.rms_eps,
            rope_theta=c.rope_theta,
        )


@dataclass(frozen=True)
class VisionSpec:
    """A ViT/SigLIP-style encoder run per frame, then radreport's temporal + spatial pooling and connector."""

    image_size: int
    patch_size: int
    channels: int
    hidden: int
    layers: int
    heads: int
    mlp: int
    ln_eps: float
    pool_stride: int
    out_hidden: int
    gelu: str = "none"  # "tanh" for SigLIP's gelu_pytorch_tanh
    prefix: str = "vision_model"
    connector: str = "connector"
    temporal_std_eps: float = 1e-6

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_image_tokens(self) -> int:
        return (self.grid // self.pool_stride) ** 2

    @classmethod
    def from_model_config(cls, c: ModelConfig) -> VisionSpec:
        return cls(
            image_size=c.image_size,
            patch_size=c.patch_size,
            channels=1,
            hidden=c.vision_hidden,
            layers=c.vision_layers,
            heads=c.vision_heads,
            mlp=c.vision_mlp,
            ln_eps=c.vision_ln_eps,
            pool_stride=c.pool_stride,
            out_hidden=c.hidden,
        )
