"""LLaVA (`model_type: llava`): a CLIP or SigLIP tower read at `vision_feature_layer`, the CLS token dropped or
kept by `vision_feature_select_strategy`, and the two-layer multi-modal projector into the language model's width.

Written from transformers' `LlavaModel.get_image_features` and `LlavaMultiModalProjector`: the tower's
`hidden_states` (embeddings first, no final norm), one layer or several concatenated along the features, then
`linear_2(act(linear_1(x)))`. Only the tower layers up to the deepest selected one are built.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.export.blocks import gelu, linear
from edgekit.export.irbuilder import GraphBuilder, scope_of

from .checkpoint import find_prefix
from .vision_tower import VisionTowerSpec, tower_spec

TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
TOWER_PREFIXES = (
    "vision_tower.",  # transformers 5's save_pretrained
    "vision_tower.vision_model.",  # checkpoints written by transformers 4 (the Hub's llava-hf models)
    "model.vision_tower.",
    "model.vision_tower.vision_model.",
)
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
PROJECTOR_ACTS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}
LM_PREFIXES = (  # (decoder module prefix, lm_head module)
    ("language_model.model.", "language_model.lm_head"),
    ("model.language_model.", "lm_head"),
)


def tower_of(cfg: dict[str, Any], names: Collection[str], where: Path) -> VisionTowerSpec:
    vcfg = cfg.get("vision_config") or {}
    vt = vcfg.get("model_type", "clip_vision_model")
    if vt not in TOWERS:
        raise ConfigError(
            f"vision_config.model_type {vt!r} is not supported for llava (edgekit builds {', '.join(TOWERS)})", where
        )
    return tower_spec(vcfg, TOWERS[vt], TOWER_PREFIXES, names, where)


def feature_layers(cfg: dict[str, Any], tower: VisionTowerSpec, where: Path) -> tuple[int, ...]:
    """`vision_feature_layer` (an index into hidden_states, which has layers + 1 entries) as non-negative indices."""
    raw = cfg.get("vision_feature_layer", -2)
    layers = [raw] if isinstance(raw, int) else list(raw) if isinstance(raw, list) else None
    if not layers or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ConfigError(f"vision_feature_layer: expected an int or a list of ints, got {raw!r}", where)
    n = tower.layers + 1
    out = tuple(i + n if i < 0 else i for i in layers)
    if any(not 0 <= i < n for i in out):
        raise ConfigError(f"vision_feature_layer {raw!r} is outside the tower's {n} hidden states", where)
    return out


def select_strategy(cfg: dict[str, Any], where: Path) -> bool:
    """True when the first token is dropped ('default': CLIP's CLS), False for 'full'."""
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ConfigError(f"vision_feature_select_strategy {strategy!r} is not one of 'default', 'full'", where)
    return strategy == "default"


def projector_prefix(names: Collection[str], where: Path) -> str:
    return find_prefix(names, PROJECTOR_PREFIXES, "linear_1.weight", where)


def projector_act(cfg: dict[str, Any], where: Path) -> str:
    act = cfg.get("projector_hidden_act", "gelu")
    if act not in PROJECTOR_ACTS:
        known = ", ".join(PROJECTOR_ACTS)
        raise ConfigError(f"projector_hidden_act {act!r} is not supported (edgekit builds {known})", where)
    return PROJECTOR_ACTS[act]


def projector_shapes(prefix: str, in_dim: int, text_hidden: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}linear_1.weight": (text_hidden, in_dim), f"{prefix}linear_2.weight": (text_hidden, text_hidden)}
    if bias:
        shapes.update({f"{prefix}linear_1.bias": (text_hidden,), f"{prefix}linear_2.bias": (text_hidden,)})
    return shapes


def select_and_project(b: GraphBuilder, states: list[ir.Value], spec) -> ir.Value:
    """hidden_states -> the selected layer(s), CLS dropped for 'default', projected: (N, tokens, text_hidden)."""
    picked = []
    for i in spec.feature_layers:
        x = states[i]
        if spec.drop_first:
            x = b.op("/select", "Slice", [x, b.const([1]), b.const([2**62]), b.const([1])])
        picked.append(x)
    x = picked[0] if len(picked) == 1 else b.op("/select", "Concat", picked, {"axis": -1})
    p = spec.connector_prefix
    y = linear(b, x, f"{p}linear_1", bias=spec.connector_bias)
    y = gelu(b, y, scope_of(p.rstrip(".")), approximate=spec.connector_act)
    return linear(b, y, f"{p}linear_2", bias=spec.connector_bias)
