"""Graph passes on onnx_ir: typed configs (`config`), the pass contract and its run (`base`), the graph patterns
passes share (`patterns`), a pipeline over model directories (`pipeline`), recipes (`recipe`), a registry of names
(`registry`) and the passes themselves (`int4`, `qembed`, `fp16`, `int8`, `lora`, `prune`, `sparse24`, `heads`)."""

from .base import (
    BoundPass,
    GraphPass,
    GraphPassResult,
    OutputError,
    PassChanges,
    PassContext,
    PassFailedError,
    PassPreconditionError,
    PassReport,
)
from .config import PassConfig, param
from .patterns import WeightMatMul, find_weight_matmuls, require_weight_matmuls
from .pipeline import PipelineResult, run_pipeline
from .recipe import Recipe, load_recipe, parse_pass_options
from .registry import available_passes, get_pass_class, make_pass, register_pass

__all__ = [
    "BoundPass",
    "GraphPass",
    "GraphPassResult",
    "OutputError",
    "PassChanges",
    "PassConfig",
    "PassContext",
    "PassFailedError",
    "PassPreconditionError",
    "PassReport",
    "PipelineResult",
    "Recipe",
    "WeightMatMul",
    "available_passes",
    "find_weight_matmuls",
    "get_pass_class",
    "load_recipe",
    "make_pass",
    "param",
    "parse_pass_options",
    "register_pass",
    "require_weight_matmuls",
    "run_pipeline",
]
