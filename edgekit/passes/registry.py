"""Pass names -> pass classes, so recipes and specs like `int4:block=32` resolve to code.

Built-in passes are named by module path and imported on first use, so importing the registry does not import
every pass's dependencies (ONNX Runtime's quantizer, safetensors); `register_pass` adds one at run time.
"""

from __future__ import annotations

import importlib

from edgekit.errors import ConfigError

from .base import GraphPass

# name -> "module:Class" (imported on first use) or the class itself once loaded
_PASSES: dict[str, str | type[GraphPass]] = {
    "int4": "edgekit.passes.int4:Int4Pass",
    "qembed": "edgekit.passes.embed:EmbedQuantPass",
    "fp16": "edgekit.passes.fp16:Fp16Pass",
    "int8": "edgekit.passes.int8:Int8Pass",
    "lora": "edgekit.passes.lora:LoraMergePass",
    "prune": "edgekit.passes.sparsity:PrunePass",
    "sparse24": "edgekit.passes.sparsity:Sparse24Pass",
    "heads": "edgekit.passes.heads:HeadPrunePass",
    "copruning": "edgekit.passes.copruning:CoPrunePass",
}


# Passes that only make sense on edgekit's own graphs, with why: refused up front on a user's ONNX file.
ROLE_BOUND: dict[str, str] = {
    "lora": "it merges a PEFT adapter by the module names edgekit's exporter gives the decoder's weights",
    "heads": "it scores and prunes attention heads by the decoder's q_proj/o_proj layout and calibration",
}


def role_bound(name: str) -> str | None:
    """Why pass `name` needs edgekit's graph roles (decoder, vision encoder, embeddings), or None."""
    return ROLE_BOUND.get(name)


def register_pass(cls: type[GraphPass], name: str | None = None) -> type[GraphPass]:
    """Register (or replace) a pass class under `name` (default `cls.name`); usable as a decorator."""
    _PASSES[name or cls.name] = cls
    return cls


def available_passes() -> list[str]:
    return sorted(_PASSES)


def get_pass_class(name: str) -> type[GraphPass]:
    entry = _PASSES.get(name)
    if entry is None:
        raise ConfigError(f"unknown pass {name!r}; available: {', '.join(available_passes())}")
    if isinstance(entry, str):
        module_name, cls_name = entry.split(":")
        entry = _PASSES[name] = getattr(importlib.import_module(module_name), cls_name)
    return entry


def make_pass(spec: str) -> GraphPass:
    """`int4:block=32,method=awq` (or just `fp16`) -> a configured pass instance."""
    name, _, params = spec.partition(":")
    return get_pass_class(name.strip()).from_string(params)
