"""ONNX export from weights (no torch, no tracing): vision encoder, token embeddings and the merged decoder."""

from .decoder import build_decoder
from .default import DECODER, EMBED_TOKENS, VISION_ENCODER, ExportedGraphs, export_default, export_model
from .embed import build_embed_tokens
from .save import EXTERNAL_DATA_THRESHOLD_BYTES, save_model, validate
from .specs import DecoderSpec, VisionSpec
from .vision import build_vision_encoder
from .weights import check_weights, expected_shapes, load_weights, random_weights

__all__ = [
    "DECODER",
    "EMBED_TOKENS",
    "VISION_ENCODER",
    "EXTERNAL_DATA_THRESHOLD_BYTES",
    "DecoderSpec",
    "VisionSpec",
    "ExportedGraphs",
    "build_decoder",
    "build_embed_tokens",
    "build_vision_encoder",
    "check_weights",
    "expected_shapes",
    "export_default",
    "export_model",
    "load_weights",
    "random_weights",
    "save_model",
    "validate",
]
