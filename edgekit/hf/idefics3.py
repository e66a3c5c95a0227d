"""Idefics3 and SmolVLM (`model_type: idefics3 | smolvlm`): a SigLIP-style tower, the pixel-shuffle connector
and the image span its processor writes around the features.

Written from transformers' `Idefics3Connector` (pixel_shuffle by `scale_factor`, then a bias-free
`modality_projection.proj`) and `Idefics3Processor`, in both of the processor's modes:
- **no split** (`do_image_splitting: false`): one image, resized to the tower's `image_size` square, with the span
  `<fake_token_around_image><global-img><image>*N<fake_token_around_image>` (N = patches / scale_factor^2);
- **splitting**: the image resized so its longest edge is `size.longest_edge` (rounded up to a multiple of
  `max_image_size.longest_edge`), cut into rows x cols tiles of `max_image_size`, plus the whole image downscaled
  to one tile (the global image); each tile's features behind `<fake_token_around_image><row_r_col_c>`, a newline
  after each row, then the global image's span. The tile count depends only on the image's aspect ratio, and
  edgekit feeds every model one square frame, so for a given processor config it is fixed: the vision graph
  takes the whole L x L frame, cuts the tiles itself (exact crops, as the processor's `unfold`) and makes the
  global image by averaging r x r blocks (Pillow's BOX at an integer factor; transformers' processor uses its
  `resample`, LANCZOS by default: the one difference, documented in docs/hf-import.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.blocks import layer_norm, linear
from edgekit.export.irbuilder import GraphBuilder

from .checkpoint import find_prefix
from .config import language_model_spec
from .tower_family import TowerFamily
from .vision_tower import VisionTowerSpec, tower_spec
from .vlm_spec import VlmSpec

TOWER_PREFIXES = ("model.vision_model.", "vision_model.")
CONNECTOR_PREFIXES = ("model.connector.", "connector.")
LM_PREFIXES = (("model.text_model.", "lm_head"), ("text_model.", "lm_head"))
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
IMAGE_TOKEN = "<image>"  # the processor writes this text for each feature position (Idefics3Processor.image_token)
# Idefics3ImageProcessor's class defaults, used where preprocessor_config.json does not say
DEFAULT_SIZE, DEFAULT_MAX_IMAGE_SIZE = 4 * 364, 364
PROCESSOR_MAX_SIDE = 4096  # transformers' MAX_IMAGE_SIZE: the resized image's cap


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


def _int_edge(pre: dict[str, Any], key: str, default: int, where: Path) -> int:
    value = pre.get(key) or {"longest_edge": default}
    edge = value.get("longest_edge") if isinstance(value, dict) else None
    if isinstance(edge, bool) or not isinstance(edge, int) or edge < 1:
        raise ConfigError(f"{key}: expected {{'longest_edge': <int>}} for image splitting, got {value!r}", where)
    return edge


def square_resize(longest: int, tile: int) -> tuple[int, int]:
    """(height, width) the processor resizes a square image to before cutting it into tiles: transformers'
    `_resize_output_size_rescale_to_max_len` (short side rounded up to even), the 4096 cap, then
    `resize_for_vision_encoder` (each side rounded up to a multiple of the tile), with its integer arithmetic."""
    h = w = longest
    if h % 2:
        h += 1
    aspect = w / h
    if w >= h and w > PROCESSOR_MAX_SIDE:
        w, h = PROCESSOR_MAX_SIDE, int(PROCESSOR_MAX_SIDE / aspect)
    elif h > w and h > PROCESSOR_MAX_SIDE:
        h, w = PROCESSOR_MAX_SIDE, int(PROCESSOR_MAX_SIDE * aspect)
    h, w = max(h, 1), max(w, 1)
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w


def split_tiles(pre: dict[str, Any] | None, tower: VisionTowerSpec, where: Path) -> int:
    """Tiles per side the processor cuts a square frame into (0: not split, the no-split span).

    `pre` is the directory's preprocessor_config.json (None: absent, so there is no processor to follow and the
    image is not split). The processor splits unless it says `do_image_splitting: false` (its class default is
    to split)."""
    if pre is None or not pre.get("do_image_splitting", True):
        return 0
    tile = _int_edge(pre, "max_image_size", DEFAULT_MAX_IMAGE_SIZE, where)
    longest = _int_edge(pre, "size", DEFAULT_SIZE, where)
    if pre.get("do_resize") is False:
        raise ConfigError("do_resize: false with image splitting: the tile count would follow each image's size", where)
    if tile != tower.image_size:
        raise ConfigError(
            f"max_image_size.longest_edge {tile} is not the vision tower's image_size {tower.image_size}: "
            "each tile is one tower input",
            where,
        )
    h, w = square_resize(longest, tile)
    if h != w:
        raise ConfigError(
            f"size.longest_edge {longest} makes the processor resize a square image to {h}x{w}; edgekit's "
            "frames are square and it builds square tilings only",
            where,
        )
    return h // tile if h > tile else 0


def split_span_text(tiles: int, seq_len: int) -> str:
    """The processor's text for one split image (`Idefics3Processor.replace_image_token` /
    SmolVLM's `_prompt_split_image`), tokenized with the model's own tokenizer into the span's ids."""
    text = ""
    for r in range(tiles):
        for c in range(tiles):
            text += f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>" + IMAGE_TOKEN * seq_len
        text += "\n"
    return text + f"\n{FAKE_TOKEN}{GLOBAL_TOKEN}" + IMAGE_TOKEN * seq_len + FAKE_TOKEN


def split_span(model_dir: Path, tiles: int, seq_len: int, image_token: int) -> tuple[int, ...]:
    """The split image's span as the processor's tokenizer gives it: the processor writes the span's text into
    the prompt and tokenizes it whole; the span opens and closes with a special token, so it tokenizes alone as
    it does in place (newlines included, however the tokenizer merges them)."""
    from tokenizers import Tokenizer

    path = model_dir / names.WEIGHT_FILES["tokenizer"]
    if not path.is_file():
        raise ConfigError("image splitting needs tokenizer.json: the split span is the tokenizer's", model_dir)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type for a foreign file
        raise ConfigError(f"not a tokenizers tokenizer.json ({type(exc).__name__})", path) from None
    ids = tuple(tokenizer.encode(split_span_text(tiles, seq_len), add_special_tokens=False).ids)
    runs: list[int] = []
    run = 0
    for t in (*ids, None):
        if t == image_token:
            run += 1
        elif run:
            runs, run = [*runs, run], 0
    if runs != [seq_len] * (tiles * tiles + 1):
        raise ConfigError(
            f"the tokenizer does not give image_token_id {image_token} for each of the processor's "
            f"{tiles * tiles + 1} x {seq_len} {IMAGE_TOKEN} tokens",
            path,
        )
    return ids


def special_id(model_dir: Path, token: str) -> int | None:
    """A special token's id from tokenizer.json's added tokens (None when the tokenizer does not have it)."""
    path = model_dir / names.WEIGHT_FILES["tokenizer"]
    if not path.is_file():
        return None
    try:
        added = json.loads(path.read_text()).get("added_tokens", [])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError("not valid JSON", path) from None
    return next((int(t["id"]) for t in added if t.get("content") == token), None)


class Idefics3(TowerFamily):
    """A SigLIP tower through its post-norm, the pixel-shuffle connector, the processor's wrapper tokens."""

    name = "idefics3"
    fallback_template = "<|im_start|>User:<image>{prompt}<end_of_utterance>\nAssistant:"

    def fields(self, cfg, model_dir, names_, pre, text, image_token):
        where = model_dir / "config.json"
        pre_path = model_dir / names.WEIGHT_FILES["preprocessor_config"]
        tower = tower_of(cfg, names_, where)
        if not np.array_equal(position_ids(tower), np.arange(tower.num_patches)):
            raise ConfigError("the vision tower's patch position ids are not the identity for a full image", where)
        fake, glob = (special_id(model_dir, t) for t in (FAKE_TOKEN, GLOBAL_TOKEN))
        sf = scale_factor(cfg, tower, where)
        tiles = split_tiles(pre, tower, pre_path)
        return dict(
            tower=tower,
            tower_layers=tower.layers,
            connector_prefix=connector_prefix(names_, where),
            decoder=language_model_spec(text, model_dir, names_, LM_PREFIXES)[0],
            scale_factor=sf,
            span_before=tuple(t for t in (fake, glob) if t is not None),
            span_after=(fake,) if fake is not None else (),
            tiles=tiles,
            split_span=split_span(model_dir, tiles, tower.num_patches // sf**2, image_token) if tiles else (),
        )

    def connector_shapes(self, spec: VlmSpec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        t = spec.tower
        final = f"{t.name('final')}"
        return {
            f"{final}.weight": (t.hidden,),
            f"{final}.bias": (t.hidden,),
            **connector_shapes(spec.connector_prefix, t, spec.scale_factor, spec.decoder.hidden),
        }

    def project(self, b: GraphBuilder, states: list[ir.Value], spec: VlmSpec) -> ir.Value:
        return pixel_shuffle_project(b, tower_output(b, states, spec), spec)

    def processor_record(self, spec: VlmSpec, hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if not spec.tiles:
            return hf, {}
        splitting = {  # the graph cuts the frame as the processor does
            "rows": spec.tiles,
            "cols": spec.tiles,
            "tile_size": spec.tower.image_size,
            "global_image": f"the frame averaged over {spec.tiles}x{spec.tiles} blocks in {names.VISION_ENCODER} "
            "(BOX at an integer factor; the processor's own resample is in hf_image_processor)",
        }
        return hf, {"image_splitting": splitting}

    def pooling(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("scale_factor") or 1)


FAMILY = Idefics3()
