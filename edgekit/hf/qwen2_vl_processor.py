"""Qwen2VLImageProcessor's arithmetic for the square frames edgekit feeds: which side it resizes them to, how the
caller's `image_size` (--image-size) pins that side, and the `pixel_values` it then writes.

Why apart from `qwen2_vl`: these are the processor's rules, not the graphs'. The spec side (`qwen2_vl`) asks them
once for the fixed side and builds constants from it; the parity check asks for the processor's own pixels; the
CLI and the build ask only whether `image_size` applies, without importing the graph builders.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgekit.errors import ConfigError

if TYPE_CHECKING:
    from .qwen2_vl import Qwen2VlSpec

# Qwen2VLImageProcessor's class defaults where preprocessor_config.json does not say
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def smart_resize(side: int, factor: int, min_pixels: int, max_pixels: int) -> int:
    """The side Qwen2VLImageProcessor's `smart_resize` gives a square image of `side` px (its arithmetic, for
    height = width)."""
    s = round(side / factor) * factor
    if s * s > max_pixels:
        beta = math.sqrt(side * side / max_pixels)
        s = max(factor, math.floor(side / beta / factor) * factor)
    elif s * s < min_pixels:
        beta = math.sqrt(min_pixels / (side * side))
        s = math.ceil(side * beta / factor) * factor
    return s


# why `image_size` (--image-size) does not apply to the other families: it pins Qwen2-VL's dynamic resolution
# only; every other family's side is fixed by its own files
SIDE_SET_BY = {
    "llava": "its side is the vision tower's vision_config.image_size (config.json)",
    "llava_next": "its side is config.json's largest square image_grid_pinpoints (crops of vision_config.image_size)",
    "idefics3": "its side is preprocessor_config.json's size.longest_edge (image splitting: tiles of "
    "max_image_size) or vision_config.image_size (no splitting)",
    "decoder": "a decoder alone takes no image",
    "vision": "its side is config.json's image_size",
    "edgekit": "its side is its config.json's image_size, fixed when it was trained",
}
SIDE_SET_BY["smolvlm"] = SIDE_SET_BY["idefics3"]


def image_size_refused(model_type: str, where: Path | None = None, kind: str = "") -> ConfigError:
    """The one-line refusal of `image_size` for a family whose side it does not set (never silently ignored);
    `kind` ("decoder", "vision", "edgekit") where the model type itself is not a VLM family."""
    why = SIDE_SET_BY.get(model_type) or SIDE_SET_BY.get(kind, "its side is set by its own config")
    return ConfigError(
        f"`image_size` pins Qwen2-VL's dynamic resolution (qwen2_vl, qwen2_5_vl) and does not apply to "
        f"{model_type}: {why}",
        where,
    )


def check_image_size(side: Any, patch: int, merge: int, where: Path) -> int:
    """`image_size` (--image-size) as a side the processor keeps: a positive multiple of patch_size * merge_size,
    else a one-line refusal naming the nearest valid sides."""
    f = patch * merge
    if isinstance(side, bool) or not isinstance(side, int) or side < 1:
        raise ConfigError(f"`image_size` {side!r}: expected a positive side in px, a multiple of {f}", where)
    if side % f:
        near = [s for s in ((side // f) * f, (side // f + 1) * f) if s > 0]
        raise ConfigError(
            f"`image_size` {side} is not a multiple of patch_size * merge_size = {f} ({patch} * {merge}, "
            f"vision_config); the nearest valid sides: {' or '.join(map(str, near))}",
            where,
        )
    return side


def pin_processor(pre: Mapping[str, Any] | None, side: int, patch: int, merge: int, temporal: int) -> dict[str, Any]:
    """The directory's image processor settings with `min_pixels = max_pixels = side**2` (and transformers 5's
    `size` alike): what Qwen2VLImageProcessor needs to give every square image the side x side grid. A new dict;
    the user's file is never written. Fields the file leaves out that the processor needs to be rebuilt from it
    (its type, the patch geometry) come from vision_config, which they were checked against."""
    out = dict(pre or {})
    out.setdefault("image_processor_type", "Qwen2VLImageProcessor")
    for key, value in (("patch_size", patch), ("merge_size", merge), ("temporal_patch_size", temporal)):
        out.setdefault(key, value)
    given = out.get("size")
    size = given if isinstance(given, dict) else {}
    out["min_pixels"] = out["max_pixels"] = side * side
    out["size"] = {**size, "shortest_edge": side * side, "longest_edge": side * side}
    return out


def fixed_side(pre: Mapping[str, Any] | None, patch: int, merge: int, where: Path) -> int:
    """The one side the processor resizes every square image to, or a one-line refusal: with
    `min_pixels` < `max_pixels` (dynamic resolution) square images of different sizes get different grids,
    and one graph shape cannot follow them. The smallest square maps to ceil(sqrt(min)/f)*f, the largest to
    floor(sqrt(max)/f)*f (f = patch * merge); the side is fixed when they agree."""
    pre = pre or {}
    given = pre.get("size")
    size = given if isinstance(given, dict) else {}
    lo = pre.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS))
    hi = pre.get("max_pixels", size.get("longest_edge", DEFAULT_MAX_PIXELS))
    for key, v in (("min_pixels", lo), ("max_pixels", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key}: expected a positive int, got {v!r}", where)
    f = patch * merge
    small, large = smart_resize(1, f, lo, hi), smart_resize(1 << 16, f, lo, hi)
    pinned = math.isqrt(lo) if lo == hi and math.isqrt(lo) ** 2 == lo else 0
    if pinned and small == pinned and smart_resize(pinned, f, lo, hi) == pinned:
        # min_pixels = max_pixels = S*S: S x S frames (what edgekit feeds) keep S. The processor's float
        # arithmetic sends some much larger images a step lower (side 392: 364 from 65536 px), which
        # was refused here as dynamic resolution before; edgekit resizes every frame to S first.
        large = pinned
    if small != large:
        raise ConfigError(
            f"min_pixels {lo} .. max_pixels {hi} give square images sides from {small} to {large} px, a grid per "
            "image size (Qwen2-VL's dynamic resolution; one graph has one shape); edgekit builds one fixed grid: "
            f"pass `image_size` S (a multiple of {f}, e.g. {max(f, min(large, 16 * f))}) to pin it, or set "
            "min_pixels = max_pixels = S*S in the file",
            where,
        )
    if pre.get("do_resize") is False:
        raise ConfigError("do_resize: false: the processor's grid would follow each image's size", where)
    return small


def hf_pixel_values(spec: Qwen2VlSpec, gray: np.ndarray) -> np.ndarray:
    """(S, S) in [0, 1] -> Qwen2VLImageProcessor's `pixel_values` (patches, C * T * p * p) for that image at its
    size: RGB, normalised, patchified in merge-window order with the frame repeated along time."""
    t = spec.tower
    c, g, m, p = t.channels, t.grid, t.merge_size, t.patch_size
    mean = np.asarray(spec.image_mean, np.float32)[:, None, None]
    std = np.asarray(spec.image_std, np.float32)[:, None, None]
    x = (np.repeat(gray[None].astype(np.float32), c, axis=0) - mean) / std
    x = x.reshape(c, g // m, m, p, g // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t.temporal_patch_size, p, p))
    return np.ascontiguousarray(x.reshape(g * g, c * t.temporal_patch_size * p * p), np.float32)
