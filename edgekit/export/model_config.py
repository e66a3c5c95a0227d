"""The vision-language architecture edgekit's graph builders write (the embedded radreport-tiny is one instance).

A SigLIP-style vision encoder run per frame, pooled across frames (mean and standard deviation, so cine motion
survives pooling) and 2x2 in space, projected into a LLaMA-style decoder (RMSNorm, RoPE, GQA, SwiGLU). Names of
weights follow Hugging Face conventions so the ONNX builders in `edgekit.export` serve imported models too.
No torch here: the config is read by the exporter, the runtime, the x1 compiler and the training code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    # vision
    image_size: int = 64
    patch_size: int = 8
    num_frames: int = 8
    vision_hidden: int = 128
    vision_layers: int = 2
    vision_heads: int = 4
    vision_mlp: int = 256
    vision_ln_eps: float = 1e-6
    pool_stride: int = 2  # spatial pooling of the patch grid before the connector
    # decoder
    vocab_size: int = 1024
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_positions: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def vision_head_dim(self) -> int:
        return self.vision_hidden // self.vision_heads

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_image_tokens(self) -> int:
        return (self.grid // self.pool_stride) ** 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
