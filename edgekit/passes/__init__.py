"""Graph passes on onnx_ir: a typed pass framework (`base`), a pipeline over model directories (`pipeline`),
recipes (`recipe`), a registry of names (`registry`) and the quantization passes (`int4`, `fp16`, `int8`)."""

from .base import (
    ALL_GRAPHS, DECODER, EMBED_TOKENS, VISION_ENCODER, GraphPass, OutputError, PassChanges, PassConfig, PassContext,
    PassFailedError, PassPreconditionError, PassReport, WeightMatMul, find_weight_matmuls, param,
    require_weight_matmuls,
)
from .pipeline import PipelineResult, run_pipeline
from .recipe import Recipe, load_recipe, parse_pass_options
from .registry import available_passes, get_pass_class, make_pass, register_pass

__all__ = [
    "ALL_GRAPHS", "DECODER", "EMBED_TOKENS", "VISION_ENCODER", "GraphPass", "OutputError", "PassChanges",
    "PassConfig", "PassContext", "PassFailedError", "PassPreconditionError", "PassReport", "PipelineResult",
    "Recipe", "WeightMatMul", "available_passes", "find_weight_matmuls", "get_pass_class", "load_recipe",
    "make_pass", "param", "parse_pass_options", "register_pass", "require_weight_matmuls", "run_pipeline",
]
