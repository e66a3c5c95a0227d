"""The small random-init model the tests share (a few thousand parameters: every builder path in milliseconds)."""

from edgekit.export.model_config import ModelConfig

SMALL = ModelConfig(
    image_size=32,
    patch_size=8,
    num_frames=2,
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
    vocab_size=97,
    hidden=48,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=96,
)
