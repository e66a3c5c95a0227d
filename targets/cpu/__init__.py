"""The `cpu` target: exported ONNX graphs run in ONNX Runtime's CPU execution provider."""

from .backend import DECODER, EMBED_TOKENS, VISION_ENCODER, CpuBackend, session_options
from .threads import physical_cores

__all__ = ["CpuBackend", "DECODER", "EMBED_TOKENS", "VISION_ENCODER", "physical_cores", "session_options"]
