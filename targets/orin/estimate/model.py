"""What is being run: the model's shape (a LLaMA-style decoder with an optional vision tower), the formats its
weights are held in, and one report's token counts.

Why together: these three are the estimate's whole input besides the device; a bundle is read into them
(`bundle.py`), a preset or `shape_from_params` makes a shape without one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgekit.decoder_shape import DecoderShape
from edgekit.errors import ConfigError

WEIGHT_DTYPES = ("fp32", "fp16", "int8", "int4")
COMPUTE_DTYPES = ("fp32", "fp16", "int8")
_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
KV_BYTES = 2.0  # the engine keeps K and V in FP16
SCALE_BYTES = 2.0  # one FP16 scale per block of a blocked INT4/INT8 weight


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"model shape field '{name}' must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class VisionShape:
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
        for name in (
            "image_size",
            "patch_size",
            "hidden",
            "layers",
            "mlp",
            "channels",
            "frames",
            "pool_stride",
            "tiles",
        ):
            _positive_int(f"vision.{name}", getattr(self, name))

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
class ModelShape(DecoderShape):
    """A LLaMA-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with an optional vision encoder."""

    vision: VisionShape | None = None

    def embedding_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def vision_params(self) -> int:
        return 0 if self.vision is None else self.vision.encoder_params() + self.vision.connector_params(self.hidden)

    def total_params(self) -> float:
        return self.decoder_params() + self.lm_head_params() + self.embedding_params() + self.vision_params()

    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * KV_BYTES

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["params"] = self.total_params()
        d["image_tokens"] = self.vision.image_tokens if self.vision else 0
        return d

    @classmethod
    def from_model_config(cls, config, name: str = "radreport-tiny") -> ModelShape:
        """edgekit's own ModelConfig (edgekit/export/model_config.py): frames pooled by mean and std, so the
        connector takes twice the encoder's width."""
        c = config
        vision = VisionShape(
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
        return cls(name, *dims, False, vision)

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "hf") -> ModelShape:
        """An imported VLM's config.json (a bundle's `model_config`): the language model from `text_config`, the
        tower from `vision_config` at the depth edgekit built (`edgekit_vlm.tower_layers`), Idefics3's pixel
        shuffle as the pooling (its connector takes the shuffled width) and its image splitting as tiles (rows x
        cols + the global image, each through the tower)."""
        from edgekit.hf.config import decoder_shape_fields, language_model_config

        text = decoder_shape_fields(language_model_config(cfg), "config.json text_config")
        v = cfg.get("vision_config") or {}
        built = cfg.get("edgekit_vlm") or {}
        vision = None
        if v and built.get("family") == "qwen2_vl":
            vision = _qwen2_vl_vision(v, built)
        elif v:
            sf = int(cfg.get("scale_factor") or 1) if built.get("family") == "idefics3" else 1
            hidden = int(v["hidden_size"])
            vision = VisionShape(
                image_size=int(v["image_size"]),
                patch_size=int(v["patch_size"]),
                hidden=hidden,
                layers=int(built.get("tower_layers") or v["num_hidden_layers"]),
                mlp=int(v["intermediate_size"]),
                channels=int(v.get("num_channels", 3)),
                pool_stride=sf,
                connector_in=hidden * sf * sf,
                tiles=(split["rows"] * split["cols"] + 1) if (split := built.get("image_splitting")) else 1,
            )
            counted = built.get("image_tokens")  # the import's own count (LLaVA-NeXT adds a newline per row)
            if isinstance(counted, int) and counted > vision.image_tokens:
                vision = dataclasses.replace(vision, extra_tokens=counted - vision.image_tokens)
        dims = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
        return cls(
            name,
            *(int(text[k]) for k in dims),
            int(text["intermediate_size"]),
            int(text["vocab_size"]),
            text["tie_word_embeddings"],
            vision,
        )


def _qwen2_vl_vision(v: dict, built: dict) -> VisionShape:
    """Qwen2-VL / Qwen2.5-VL's tower at the fixed side edgekit built (`edgekit_vlm.image_size`): every patch
    through the blocks, the 2 x 2 merge as the pooling (the merger takes 4 patches' width), the still image's
    temporal copies as input channels of the patch embedding. Qwen2.5-VL's SwiGLU counts three matrices (mlp =
    1.5 x intermediate) and its windowed blocks are costed as full attention: edgekit's graph computes every
    score and masks the ones outside a window (a constant block mask, edgekit.hf.qwen2_vl), so that is what the
    engine runs; a window-by-window kernel would do 1 / windows of it."""
    merge = int(v.get("spatial_merge_size", 2))
    if built.get("model_type") == "qwen2_5_vl":
        hidden, mlp = int(v["hidden_size"]), int(1.5 * int(v["intermediate_size"]))
    else:
        hidden = int(v["embed_dim"])
        mlp = int(hidden * float(v.get("mlp_ratio", 4)))
    return VisionShape(
        image_size=int(built["image_size"]),
        patch_size=int(v["patch_size"]),
        hidden=hidden,
        layers=int(built.get("tower_layers") or v["depth"]),
        mlp=mlp,
        channels=int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)),
        pool_stride=merge,
        connector_in=hidden * merge * merge,
    )


# SigLIP-B/16 at 256 px: 256 image tokens, ~86M parameters (the usual vision tower of a ~1B VLM)
SIGLIP_B16_256 = VisionShape(image_size=256, patch_size=16, hidden=768, layers=12, mlp=3072)


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
    vision: VisionShape | None = SIGLIP_B16_256,
    name: str | None = None,
) -> ModelShape:
    """A shape for a model known by its size: the MLP width is solved so the parameters add up to `params`
    (vision tower and embeddings included), so a 1.2B model can be estimated without a bundle."""
    hd = head_dim or hidden // heads
    probe = ModelShape("probe", hidden, layers, heads, kv_heads, hd, 1, vocab, tied_embeddings, vision)
    rest = params - probe.lm_head_params() - probe.embedding_params() - probe.vision_params()
    attn = layers * (2 * hidden * heads * hd + 2 * hidden * kv_heads * hd)
    intermediate = int(round((rest - attn) / (3 * hidden * layers)))
    if intermediate < 1:
        raise ConfigError(
            f"model shape field 'params': {params:.3g} is too small for {layers} layers of width {hidden} "
            "with this vocabulary and vision tower"
        )
    label = name or f"{params / 1e9:.3g}b"
    return ModelShape(label, hidden, layers, heads, kv_heads, hd, intermediate, vocab, tied_embeddings, vision)


def _seed_shape() -> ModelShape:
    # The seed names only "a 1.2B medical VLM". Assumed: a TinyLlama-1.1B-shaped decoder with a SigLIP-B/16 tower
    # and a LLaVA-style 2-layer connector: 1.19B parameters, 256 image tokens.
    return ModelShape("seed-1.2b", 2048, 22, 32, 4, 64, 5632, 32000, False, SIGLIP_B16_256)


def _radreport_tiny() -> ModelShape:
    from edgekit.export.model_config import ModelConfig
    from edgekit.plugins import get_model_family

    return ModelShape.from_model_config(ModelConfig.load(get_model_family().weights_dir() / "config.json"))


PRESETS = {
    "seed-1.2b": _seed_shape,
    "radreport-tiny": _radreport_tiny,
    # decoders of NVIDIA's published Orin Nano tokens/s ([references] in devices.toml), from their HF configs
    "llama-3.1-8b": lambda: ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False),
    "llama-3.2-3b": lambda: ModelShape("llama-3.2-3b", 3072, 28, 24, 8, 128, 8192, 128256, True),
    "smollm2-1.7b": lambda: ModelShape("smollm2-1.7b", 2048, 24, 32, 32, 64, 8192, 49152, True),
}


def preset(name: str) -> ModelShape:
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
        _positive_int("block", self.block)
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
