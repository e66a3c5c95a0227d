"""LLaVA (`model_type: llava`): a CLIP or SigLIP tower read at `vision_feature_layer`, the CLS token dropped or
kept by `vision_feature_select_strategy`, and the two-layer multi-modal projector into the language model's width.

Written from transformers' `LlavaModel.get_image_features` and `LlavaMultiModalProjector`: the tower's
`hidden_states` (embeddings first, no final norm), one layer or several concatenated along the features, then
`linear_2(act(linear_1(x)))`. Only the tower layers up to the deepest selected one are built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.export.blocks import gelu, linear
from edgekit.export.irbuilder import GraphBuilder, scope_of

from .checkpoint import find_prefix
from .config import language_model_spec
from .tower_family import TowerFamily
from .vision_tower import VisionTowerSpec, tower_spec
from .vlm_spec import VlmSpec

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
NEWLINE_MODULE = "model.image_newline"  # LLaVA-NeXT's image_newline parameter under transformers 5's module name


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
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}linear_1.weight": (text_hidden, in_dim),
        f"{prefix}linear_2.weight": (text_hidden, text_hidden),
    }
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


LLAVA_MODULES = {"tower": "model.vision_tower.", "connector": "model.multi_modal_projector."}
LLAVA_LM, LLAVA_HEAD = "model.language_model.", "lm_head"


def module_names(spec: VlmSpec) -> VlmSpec:
    """LLaVA's graph under transformers 5's module names (`model.language_model.layers.0...`,
    `model.vision_tower...`, `lm_head`), whichever layout its checkpoint was saved in (transformers 4 and 5 both
    write `language_model.model.*` / `vision_tower.*` to disk)."""
    d = spec.decoder
    lm = d.layer_prefix[: -len("layers")]
    pairs = [
        (spec.tower.prefix, LLAVA_MODULES["tower"]),
        (spec.connector_prefix, LLAVA_MODULES["connector"]),
        (lm, LLAVA_LM),
    ]
    if not d.lm_head.startswith(lm):  # untied: its own module
        pairs.append((d.lm_head, LLAVA_HEAD))
    if spec.newline:  # llava_next's image_newline parameter
        pairs.append((spec.newline, NEWLINE_MODULE))
    renames = tuple((c, m) for c, m in pairs if c != m)
    named = dataclasses.replace(spec, renames=renames)
    return dataclasses.replace(
        named,
        tower=dataclasses.replace(spec.tower, prefix=LLAVA_MODULES["tower"]),
        connector_prefix=LLAVA_MODULES["connector"],
        decoder=dataclasses.replace(
            d,
            layer_prefix=named.to_module(d.layer_prefix),
            embed_tokens=named.to_module(d.embed_tokens),
            final_norm=named.to_module(d.final_norm),
            lm_head=named.to_module(d.lm_head),
        ),
    )


class Llava(TowerFamily):
    name = "llava"
    fallback_template = "USER: <image>\n{prompt} ASSISTANT:"

    def fields(self, cfg, model_dir, names_, pre, text, image_token):
        where = model_dir / "config.json"
        tower = tower_of(cfg, names_, where)
        layers = feature_layers(cfg, tower, where)
        return dict(
            tower=tower,
            tower_layers=max(layers),
            connector_prefix=projector_prefix(names_, where),
            decoder=language_model_spec(text, model_dir, names_, LM_PREFIXES)[0],
            feature_layers=layers,
            drop_first=select_strategy(cfg, where),
            connector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            connector_act=projector_act(cfg, where),
        )

    def finish(self, spec: VlmSpec, where: Path) -> VlmSpec:
        return module_names(spec)

    def image_tokens(self, spec: VlmSpec) -> int:
        return spec.tower.num_tokens - (1 if spec.drop_first else 0)

    def connector_shapes(self, spec: VlmSpec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        in_dim = spec.tower.hidden * len(spec.feature_layers)
        return projector_shapes(spec.connector_prefix, in_dim, spec.decoder.hidden, spec.connector_bias)

    def project(self, b: GraphBuilder, states: list[ir.Value], spec: VlmSpec) -> ir.Value:
        return select_and_project(b, states, spec)

    def hf_pixel_values(self, spec: VlmSpec, gray: np.ndarray) -> np.ndarray:
        """LLaVA's processor gives one image as (1, C, S, S)."""
        return super().hf_pixel_values(spec, gray)[0]


FAMILY = Llava()
