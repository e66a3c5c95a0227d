"""LLaVA-NeXT (`model_type: llava_next`, LLaVA 1.6): LLaVA's tower and projector, with the processor's "anyres"
tiling fixed for edgekit's one square frame.

Written from transformers' `LlavaNextImageProcessor` (`select_best_resolution` among `image_grid_pinpoints`, the
image resized and padded to it, cut into crops of the tower's size, the whole image resized to the tower's size in
front of them), `LlavaNextModel.pack_image_features` (the crops' features laid out as one (rows*p, cols*p) map,
unpadded to the image's aspect ratio, `image_newline` after each row, behind the base image's features) and
`LlavaNextProcessor._get_number_of_features` (the span's length). The grid depends only on the image's size, and
edgekit feeds every model one square frame, so it is fixed per model: edgekit's frame is the largest square
pinpoint (S x S, a multiple of the tower's size M), which the processor picks for an S x S image, resizes to
itself (no resize) and cuts into (S/M)^2 exact crops; a square image on a square grid loses nothing to the
unpadding. The vision graph takes the S x S frame, cuts the crops itself and makes the base image by averaging
(S/M) x (S/M) blocks (Pillow's BOX at that integer factor; transformers' processor uses its `resample`, BICUBIC
by default: the one difference, documented in docs/hf-import.md).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.irbuilder import GraphBuilder

from .llava import NEWLINE_MODULE, Llava
from .tower_family import TowerFamily
from .vision_tower import VisionTowerSpec
from .vlm_spec import VlmSpec

# LlavaNextConfig's default pinpoints (llava-v1.6's), used where config.json does not say
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
NEWLINE_NAMES = ("image_newline", "model.image_newline")  # transformers 4/5 on disk; transformers 5's module


def pinpoints(cfg: dict[str, Any], where: Path) -> tuple[tuple[int, int], ...]:
    raw = cfg.get("image_grid_pinpoints")
    if raw is None:
        return DEFAULT_PINPOINTS
    ok = isinstance(raw, list) and raw and all(isinstance(p, list) and len(p) == 2 for p in raw)
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for p in raw for v in p)
    if not ok:
        raise ConfigError(f"image_grid_pinpoints: expected a list of [height, width] ints, got {raw!r}", where)
    return tuple((int(h), int(w)) for h, w in raw)


def select_best_resolution(original: tuple[int, int], possible: Collection[tuple[int, int]]) -> tuple[int, int]:
    """transformers' `select_best_resolution`: the pinpoint keeping the most of the image, then wasting least."""
    oh, ow = original
    best: tuple[int, int] | None = None
    best_effective, best_wasted = 0, float("inf")
    for h, w in possible:
        scale = min(w / ow, h / oh)
        effective = min(int(ow * scale) * int(oh * scale), ow * oh)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    if best is None:
        raise ValueError("select_best_resolution: no resolutions to choose from")
    return best


def unpadded_features(orig: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int]:
    """(rows, cols) of the feature map left by `unpad_image` / `_get_unpadded_features` (their arithmetic)."""
    (oh, ow), (ch, cw) = orig, grid
    if ow / oh > cw / ch:
        pad = (ch - int(round(oh * (cw / ow), 7))) // 2
        return ch - 2 * pad, cw
    pad = (cw - int(round(ow * (ch / oh), 7))) // 2
    return ch, cw - 2 * pad


def _crop_size(pre: dict[str, Any] | None, tower: VisionTowerSpec) -> int:
    """The processor's crop side (its `_preprocess`: crop_size.height, else size.height, else size.shortest_edge)."""
    if pre is None:
        return tower.image_size
    for key, field in (("crop_size", "height"), ("size", "height"), ("size", "shortest_edge")):
        v = pre.get(key)
        if isinstance(v, dict) and v.get(field):
            return v[field]
    return tower.image_size


def grid_side(cfg: dict[str, Any], pre: dict[str, Any] | None, tower: VisionTowerSpec, where: Path, pre_path) -> int:
    """Crops per side of edgekit's square frame: the largest square pinpoint, over the tower's image size."""
    points = pinpoints(cfg, where)
    if pre is not None and pre.get("image_grid_pinpoints") is not None:
        theirs = pinpoints(pre, pre_path)
        if theirs != points:
            raise ConfigError(
                f"image_grid_pinpoints {[list(p) for p in theirs]} differ from config.json's "
                f"{[list(p) for p in points]}: the processor would count another span than the model packs",
                pre_path,
            )
    m = tower.image_size
    crop = _crop_size(pre, tower)
    if crop != m:
        raise ConfigError(
            f"the processor's crop size {crop!r} is not the vision tower's image_size {m}: "
            "each crop is one tower input",
            pre_path,
        )
    squares = [h for h, w in points if h == w and h % m == 0]
    if not squares:
        raise ConfigError(
            f"image_grid_pinpoints {[list(p) for p in points]} hold no square multiple of the tower's {m} px: "
            "edgekit's frames are square and it builds square tilings only",
            where,
        )
    side = max(squares)
    assert select_best_resolution((side, side), points) == (side, side)  # a square pinpoint wins for its own size
    return side // m


def check_tokens(spec, where: Path) -> None:
    """pack_image_features lays each crop's tokens out as the tower's patch grid: the tokens after the select
    strategy must be that grid (CLIP with 'default', a SigLIP tower with 'full')."""
    side = spec.tower.image_size // spec.tower.patch_size
    got = spec.tower.num_tokens - (1 if spec.drop_first else 0)
    if got != side * side:
        raise ConfigError(
            f"vision_feature_select_strategy leaves {got} tokens per crop, not the tower's {side}x{side} patch grid "
            "that LLaVA-NeXT's feature map is made of",
            where,
        )


def newline_name(names: Collection[str], where: Path) -> str:
    name = next((n for n in NEWLINE_NAMES if n in names), None)
    if name is None:
        raise ConfigError(f"no image_newline weight found (looked for {', '.join(NEWLINE_NAMES)})", where)
    return name


def num_image_tokens(spec) -> int:
    """The processor's count: the base image's patches, then the (unpadded) grid map with a newline per row."""
    side = spec.tower.image_size // spec.tower.patch_size
    s = spec.image_size
    rows, cols = unpadded_features((s, s), (spec.tiles * side, spec.tiles * side))
    return side * side + rows * (cols + 1)


def pack(b: GraphBuilder, y: ir.Value, spec) -> ir.Value:
    """(B * (1 + r*r), p*p, H) projected features -> (B, span, H): `pack_image_features` for a square grid of a
    square image (the unpadding removes nothing): base tokens, then each of the r*p rows of the grid's map with
    `image_newline` after it."""
    scope = "/image_span/anyres"
    r, p, h = spec.tiles, spec.tower.image_size // spec.tower.patch_size, spec.decoder.hidden
    y = b.op(scope, "Reshape", [y, b.const([-1, 1 + r * r, p * p, h])])
    base = b.op(scope, "Slice", [y, b.const([0]), b.const([1]), b.const([1])])
    base = b.op(scope, "Reshape", [base, b.const([-1, p * p, h])])
    grid = b.op(scope, "Slice", [y, b.const([1]), b.const([1 + r * r]), b.const([1])])
    grid = b.op(scope, "Reshape", [grid, b.const([-1, r, r, p, p, h])])  # (B, crop row, crop col, y, x, H)
    grid = b.op(scope, "Transpose", [grid], {"perm": [0, 1, 3, 2, 4, 5]})
    grid = b.op(scope, "Reshape", [grid, b.const([-1, r * p, r * p, h])])
    newline = b.op(scope, "Reshape", [b.weight(NEWLINE_MODULE), b.const([1, 1, 1, h])])
    shape = b.op(scope, "Concat", [b.op(scope, "Shape", [grid], {"start": 0, "end": 2}), b.const([1, h])], {"axis": 0})
    grid = b.op(scope, "Concat", [grid, b.op(scope, "Expand", [newline, shape])], {"axis": 2})
    grid = b.op(scope, "Reshape", [grid, b.const([-1, r * p * (r * p + 1), h])])
    return b.op(scope, "Concat", [base, grid], {"axis": 1})


class LlavaNext(Llava):
    """LLaVA's tower and projector, the frame cut into the anyres grid, the features packed with newlines."""

    name = "llava_next"
    clip_defaults = True
    hf_pixel_values = TowerFamily.hf_pixel_values  # the crops and the base image, (1, r*r + 1, C, M, M)

    def fields(self, cfg, model_dir, names_, pre, text, image_token):
        own = super().fields(cfg, model_dir, names_, pre, text, image_token)
        where, pre_path = model_dir / "config.json", model_dir / names.WEIGHT_FILES["preprocessor_config"]
        return {
            **own,
            "tiles": grid_side(cfg, pre, own["tower"], where, pre_path),
            "newline": newline_name(names_, where),
            "whole_image_first": True,  # the base image before the crops
        }

    def finish(self, spec: VlmSpec, where: Path) -> VlmSpec:
        check_tokens(spec, where)
        return super().finish(spec, where)

    def image_tokens(self, spec: VlmSpec) -> int:
        return num_image_tokens(spec)

    def connector_shapes(self, spec: VlmSpec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        return {**super().connector_shapes(spec, cfg), NEWLINE_MODULE: (spec.decoder.hidden,)}

    def project(self, b: GraphBuilder, states: list[ir.Value], spec: VlmSpec) -> ir.Value:
        return pack(b, super().project(b, states, spec), spec)

    def hf_image_inputs(self, spec: VlmSpec, gray: np.ndarray) -> dict[str, Any]:
        import torch

        return {**super().hf_image_inputs(spec, gray), "image_sizes": torch.tensor([list(gray.shape)])}

    def processor_record(self, spec: VlmSpec, hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        anyres = {  # the graph cuts the frame as the processor's anyres does
            "grid_pinpoint": [spec.image_size, spec.image_size],
            "rows": spec.tiles,
            "cols": spec.tiles,
            "crop_size": spec.tower.image_size,
            "base_image": f"the frame averaged over {spec.tiles}x{spec.tiles} blocks in {names.VISION_ENCODER} "
            "(BOX at an integer factor; the processor's own resample is in hf_image_processor)",
        }
        return hf, {"anyres": anyres}


FAMILY = LlavaNext()
