"""Import of local Hugging Face checkpoints (LLaMA/Qwen2 decoders, ViT/SigLIP vision encoders, and whole VLMs:
LLaVA, LLaVA-NeXT, Idefics3/SmolVLM, Qwen2-VL/Qwen2.5-VL) into edgekit's ONNX graphs, with weights read lazily one
tensor at a time so big models convert in bounded memory."""

from .checkpoint import SafetensorsCheckpoint
from .config import SUPPORTED_MODEL_TYPES, decoder_spec, is_hf_model_dir, read_hf_config
from .convert import HfConversion, convert_hf

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HfConversion",
    "SafetensorsCheckpoint",
    "convert_hf",
    "decoder_spec",
    "is_hf_model_dir",
    "read_hf_config",
]
