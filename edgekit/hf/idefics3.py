"""Idefics3 and SmolVLM (`model_type: idefics3 | smolvlm`): a SigLIP-style tower, the pixel-shuffle connector
and the image span its processor writes around the features.

Written from transformers' `Idefics3Connector` (pixel_shuffle by `scale_factor`, then a bias-free
`modality_projection.proj`) and `Idefics3Processor`. edgekit imports the processor's **no-split** mode: one
image, resized to the tower's `image_size` square, with the span
`<fake_token_around_image><global-img><image>*N<fake_token_around_image>` (N = patches / scale_factor^2). The
splitting mode (up to 4x4 tiles of `max_image_size` plus the global image, each tile with its own
`<row_r_col_c>` marker) is not built: it needs a tile count that depends on the image's aspect ratio, which a
fixed-shape graph fed one display frame does not have.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.export.blocks import layer_norm, linear
from edgekit.export.irbuilder import GraphBuilder

from .checkpoint import find_prefix
from .vision_tower import VisionTowerSpec, tower_spec

TOWER_PREFIXES = ("model.vision_model.", "vision_model.")
CONNECTOR_PREFIXES = ("model.connector.", "connector.")
LM_PREFIXES = (("model.text_model.", "lm_head"), ("text_model.", "lm_head"))
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


def tower_of(cfg: dict[str, Any], names: Collection[str], where: Path) -> VisionTowerSpec:
    return tower_spec(cfg.get("vision_config") or {}, "siglip", TOWER_PREFIXES, names, where)


def scale_factor(cfg: dict[str, Any], tower: VisionTowerSpec, where: Path) -> int:
    s = cfg.get("scale_factor", 2)
    side = tower.image_size // tower.patch_size
    if isinstance(s, bool) or not isinstance(s, int) or s < 1 or side % s:
        raise ConfigError(f"scale_factor {s!r} does not divide the tower's {side}x{side} patch grid", where)
    return s


def connector_prefix(names: Collection[str], where: Path) -> str:
    return find_prefix(names, CONNECTOR_PREFIXES, "modality_projection.proj.weight", where)


def position_ids(tower: VisionTowerSpec) -> np.ndarray:
    """The patch position ids `Idefics3VisionEmbeddings` computes for a full (unpadded) image: fractional
    coordinates bucketized against the grid's boundaries, in float32 as torch does (the identity in practice)."""
    n = tower.image_size // tower.patch_size
    boundaries = np.arange(1 / n, 1.0, 1 / n, dtype=np.float32)
    coords = np.arange(0, 1 - 1e-6, 1 / n, dtype=np.float32)
    bucket = np.searchsorted(boundaries, coords, side="right")
    return (bucket[:, None] * n + bucket[None, :]).reshape(-1).astype(np.int64)


def connector_shapes(prefix: str, tower: VisionTowerSpec, s: int, text_hidden: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}modality_projection.proj.weight": (text_hidden, tower.hidden * s * s)}


def tower_output(b: GraphBuilder, states: list[ir.Value], spec) -> ir.Value:
    """Idefics3's tower output is last_hidden_state: the final layer through post_layernorm."""
    return layer_norm(b, states[-1], spec.tower.name("final"), spec.tower.ln_eps)


def pixel_shuffle_project(b: GraphBuilder, x: ir.Value, spec) -> ir.Value:
    """`Idefics3Connector.pixel_shuffle` reshape for reshape, then the projection: (N, P, D) -> (N, P/s^2, H)."""
    scope = "/connector/pixel_shuffle"
    s, d = spec.scale_factor, spec.tower.hidden
    side = spec.tower.image_size // spec.tower.patch_size
    x = b.op(scope, "Reshape", [x, b.const([-1, side, side // s, d * s])])
    x = b.op(scope, "Transpose", [x], {"perm": [0, 2, 1, 3]})
    x = b.op(scope, "Reshape", [x, b.const([-1, side // s, side // s, d * s * s])])
    x = b.op(scope, "Transpose", [x], {"perm": [0, 2, 1, 3]})
    x = b.op(scope, "Reshape", [x, b.const([-1, side * side // (s * s), d * s * s])])
    return linear(b, x, f"{spec.connector_prefix}modality_projection.proj", bias=False)
