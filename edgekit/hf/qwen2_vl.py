"""Qwen2-VL and Qwen2.5-VL (`model_type: qwen2_vl | qwen2_5_vl`) at one fixed square resolution: the vision
transformer and patch merger into `vision_encoder.onnx`, the Qwen2 language model with M-RoPE into the decoder.

Why one resolution: Qwen2-VL's processor resizes each image to its own multiple of 28 px (`smart_resize`, within
`min_pixels`..`max_pixels`), so the patch count, the span's length and the (3, batch, seq) positions follow each
image's size; one ONNX graph of fixed shape cannot follow them. edgekit feeds every model one square frame, so
at the side S the processor gives every square image (its `min_pixels = max_pixels`, or the caller's
`image_size`, --image-size, which pins the processor to S: `pin_processor`) the grid is fixed (grid_t 1,
grid_h = grid_w = S / patch) and everything the processor and the model compute from the grid becomes a constant
of the graph:
- the processor's patch order (2 x 2 merge windows, row by row) is a Reshape/Transpose of the frame;
- its `temporal_patch_size` copies of a still image and the Conv3d patch embedding are one MatMul over the
  flattened (channel, time, row, column) patch, the frame repeated along time, as the processor repeats it;
- the vision 2-D rotary tables (`Qwen2VLVisionRotaryEmbedding` over each patch's row and column) are constants;
- the merger's `ln_q` + MLP over each 2 x 2 window of consecutive patches, as transformers' `PatchMerger`.
Qwen2.5-VL's vision blocks are RMSNorm + SwiGLU (with biases) and attend within windows of
`window_size` px except in `fullatt_block_indexes`: at the fixed grid the window permutation
(`get_vision_window_index`) is a constant Gather of 2 x 2 merge units (and of the rotary tables), the windows a
constant block mask on the scores (a window id per patch, compared), and the merger's output is gathered back
(`argsort` of the permutation). Its image M-RoPE positions are Qwen2-VL's (`tokens_per_second` only spaces a
video's frames; an image has one).
The image span is the `<|image_pad|>` tokens alone (`<|vision_start|>` / `<|vision_end|>` stay text in the
chat template, as the processor leaves them), and its M-RoPE grid, (1, S / (patch * merge), same), is recorded
in the bundle (`edgekit.positions`) for the runtime to place the positions.
The processor's own arithmetic (`smart_resize`, the fixed side, pinning it, its `pixel_values`) is in
`qwen2_vl_processor`, the vision graph in `qwen2_vl_graph`; `FAMILY` answers for both model types.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.specs import DecoderSpec
from edgekit.model_description import VisionDescription
from edgekit.positions import MROPE, PositionScheme

from .checkpoint import find_prefix
from .config import language_model_config, language_model_spec, rope_parameters
from .family import VlmFamily
from .qwen2_vl_processor import check_image_size, fixed_side, hf_pixel_values, pin_processor
from .spec_base import VlmSpecBase
from .vision_tower import GELU
from .vlm_spec import check_span_fits, mean_std

VISUAL_PREFIXES = ("visual.", "model.visual.")  # the Hub's layout (and transformers 5's save_pretrained), modules
LM_PREFIXES = (("model.language_model.", "lm_head"), ("model.", "lm_head"))
VISUAL_MODULE, LM_MODULE = "model.visual.", "model.language_model."


@dataclass(frozen=True)
class Qwen2VisionSpec:
    """Qwen2-VL's vision transformer at the fixed square side `image_size`."""

    image_size: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    channels: int
    hidden: int  # embed_dim
    layers: int  # depth
    heads: int
    mlp: int
    out_hidden: int  # the merger's output: the language model's width
    act: str  # edgekit.hf.vision_tower.GELU kind
    rope_theta: float
    prefix: str = VISUAL_MODULE
    family: str = "qwen2_vl_vision"  # "qwen2_5_vl_vision": RMSNorm + SwiGLU blocks, windowed attention
    ln_eps: float = 1e-6
    window: int = 0  # Qwen2.5-VL: window side in merged tokens (window_size // merge // patch); 0: none
    full_attention: tuple[int, ...] = ()  # Qwen2.5-VL: the blocks that attend over the whole image

    @property
    def v25(self) -> bool:
        return self.family == "qwen2_5_vl_vision"

    @property
    def grid(self) -> int:
        """Patches per side (the processor's grid_h = grid_w)."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        """The language model's (t, h, w) grid of the image: what get_rope_index reads from image_grid_thw."""
        g = self.grid // self.merge_size
        return (1, g, g)


@dataclass(frozen=True)
class Qwen2VlSpec(VlmSpecBase):
    """What the three graphs of a Qwen2-VL need; the same interface as `edgekit.hf.vlm.VlmSpec` where serving,
    parity and conversion read one (the span, the normalisation, the names)."""

    model_type: str
    tower: Qwen2VisionSpec
    decoder: DecoderSpec
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    image_token_id: int
    renames: tuple[tuple[str, str], ...] = ()
    family: str = "qwen2_vl"
    text_model_type: str = "qwen2"
    tiles: int = 0
    span_before: tuple[int, ...] = ()
    span_after: tuple[int, ...] = ()
    split_span: tuple[int, ...] = ()
    pinned: bool = False  # the side came from the caller (`image_size`, --image-size), not the directory's file

    @property
    def image_size(self) -> int:
        return self.tower.image_size

    @property
    def tower_layers(self) -> int:
        return self.tower.layers

    def processor_config(self, pre: Mapping[str, Any] | None) -> dict[str, Any]:
        """The image processor settings that go with these graphs: the directory's own, pinned to the side when
        the caller set it (so transformers' processor built from them gives the vision graph's grid)."""
        t = self.tower
        if not self.pinned:
            return dict(pre or {})
        return pin_processor(pre, t.image_size, t.patch_size, t.merge_size, t.temporal_patch_size)

    @property
    def num_images(self) -> int:
        return 1

    @property
    def num_image_tokens(self) -> int:
        t, h, w = self.tower.merged_grid
        return t * h * w

    @property
    def span_ids(self) -> list[int]:
        return [self.image_token_id] * self.num_image_tokens

    @property
    def wrapper_ids(self) -> list[int]:
        return []

    @property
    def span_length(self) -> int:
        return self.num_image_tokens

    @property
    def positions(self) -> PositionScheme:
        return PositionScheme(MROPE, self.tower.merged_grid)

    def family_summary(self) -> dict[str, Any]:
        return {
            "image_grid_thw": [1, self.tower.grid, self.tower.grid],
            **(
                {"window": self.tower.window, "full_attention": list(self.tower.full_attention)}
                if self.tower.window
                else {}
            ),
            "mrope_section": list(self.decoder.mrope_section or ()),
            "image_size_from": "the image_size argument (--image-size)" if self.pinned else "preprocessor_config.json",
        }


def _int(d: Mapping, key: str, default: int, where: Path) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{key}: expected a positive int, got {v!r}", where)
    return v


def _positive(d: Mapping, key: str, default: float, where: Path) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"{key}: expected a positive number, got {v!r}", where)
    return float(v)


def tower_of(
    cfg: dict[str, Any],
    pre: Mapping[str, Any] | None,
    text_hidden: int,
    where: Path,
    pre_where: Path,
    image_size: int | None = None,
):
    """The vision tower's spec at its fixed side: the one the processor's `min_pixels`/`max_pixels` give, or
    `image_size` when the caller pins it (the processor then pinned to it, `pin_processor`)."""
    v = cfg.get("vision_config") or {}
    if not isinstance(v, dict):
        raise ConfigError("vision_config: expected an object", where)
    patch = _int(v, "patch_size", 14, where)
    merge = _int(v, "spatial_merge_size", 2, where)
    temporal = _int(v, "temporal_patch_size", 2, where)
    for key, own in (("patch_size", patch), ("merge_size", merge), ("temporal_patch_size", temporal)):
        if pre and key in pre and pre[key] != own:
            raise ConfigError(f"{key} {pre[key]!r} is not vision_config's {own}", pre_where)
    act = v.get("hidden_act", "silu" if cfg.get("model_type") == "qwen2_5_vl" else "quick_gelu")
    if act not in GELU and cfg.get("model_type") != "qwen2_5_vl":
        raise ConfigError(f"vision_config.hidden_act {act!r} is not supported ({', '.join(GELU)})", where)
    v25 = cfg.get("model_type") == "qwen2_5_vl"
    # Qwen2-VL: embed_dim is the tower's width, hidden_size the merger's output; Qwen2.5-VL: hidden_size and
    # out_hidden_size
    embed = _int(v, "hidden_size" if v25 else "embed_dim", 1280, where)
    heads = _int(v, "num_heads", 16, where)
    if embed % heads or (embed // heads) % 4:
        raise ConfigError(f"vision_config: width {embed} / num_heads {heads} must be a multiple of 4", where)
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"vision_config.rope_parameters: expected an object, got {rope!r}", where)
    extra: dict[str, Any] = {}
    if v25:
        if act != "silu":
            raise ConfigError(f"vision_config.hidden_act {act!r}: Qwen2.5-VL's vision MLP is SwiGLU with silu", where)
        window = _int(v, "window_size", 112, where) // merge // patch
        if window < 1:
            raise ConfigError(f"window_size {v.get('window_size')} is under one merge unit ({merge * patch} px)", where)
        full = v.get("fullatt_block_indexes", [7, 15, 23, 31])
        if not isinstance(full, list) or not all(isinstance(i, int) for i in full):
            raise ConfigError(f"fullatt_block_indexes: expected a list of ints, got {full!r}", where)
        extra = dict(family="qwen2_5_vl_vision", window=window, full_attention=tuple(full))
    if image_size is not None:
        pre = pin_processor(pre, check_image_size(image_size, patch, merge, where), patch, merge, temporal)
    return Qwen2VisionSpec(
        **extra,
        image_size=fixed_side(pre, patch, merge, pre_where),
        patch_size=patch,
        temporal_patch_size=temporal,
        merge_size=merge,
        channels=_int(v, "in_channels", v.get("in_chans", 3), where),
        hidden=embed,
        layers=_int(v, "depth", 32, where),
        heads=heads,
        mlp=_int(v, "intermediate_size", 3420, where) if v25 else int(embed * _positive(v, "mlp_ratio", 4, where)),
        out_hidden=_int(v, "out_hidden_size" if v25 else "hidden_size", text_hidden, where),
        act="silu" if v25 else GELU[act],
        rope_theta=_positive(rope, "rope_theta", 10000.0, where),
    )


def text_config(cfg: dict[str, Any], where: Path) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The language model's config as a Qwen2 decoder's (transformers 5: `text_config`; the Hub's 4.x files:
    the top level), and its `mrope_section`."""
    text = cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"}
    if not isinstance(text, dict):
        raise ConfigError(f"text_config: expected an object, got {text!r}", where)
    text = dict(text)
    params = rope_parameters(text)
    section = params.pop("mrope_section", None)
    if params.get("rope_type") == "mrope":  # transformers 4's name for Qwen2-VL's default rope
        params["rope_type"] = "default"
    if not isinstance(section, list) or not section or not all(isinstance(x, int) and x > 0 for x in section):
        raise ConfigError(f"rope_parameters.mrope_section: expected a list of positive ints, got {section!r}", where)
    text.pop("rope_scaling", None)
    text["rope_parameters"] = params
    text["model_type"] = "qwen2"
    if text.get("use_sliding_window"):
        raise ConfigError("use_sliding_window = true is not supported (edgekit attends over the full cache)", where)
    text.pop("use_sliding_window", None)
    return text, tuple(section)


def qwen2_vl_spec(
    cfg: dict[str, Any], model_dir: Path, names_: Collection[str], pre, mean_std, image_size: int | None = None
) -> Qwen2VlSpec:
    """config.json (+ the checkpoint's names, preprocessor_config.json as `pre`) -> Qwen2VlSpec.
    `mean_std(tower)`: the processor's normalisation (edgekit.hf.vlm's reader, CLIP's defaults). `image_size`:
    the fixed side, pinning the processor's dynamic resolution (None: the side its file fixes)."""
    where = model_dir / "config.json"
    pre_where = model_dir / names.WEIGHT_FILES["preprocessor_config"]
    text, section = text_config(cfg, where)
    image_token = cfg.get("image_token_id", 151655)
    if isinstance(image_token, bool) or not isinstance(image_token, int):
        raise ConfigError(f"image_token_id: expected an int, got {image_token!r}", where)
    tied = bool(language_model_config(cfg).get("tie_word_embeddings", False))  # the top level's where it is set
    d, lm = language_model_spec(text, model_dir, names_, LM_PREFIXES, module=LM_MODULE, tied=tied)
    if sum(section) * 2 != d.head_dim:
        raise ConfigError(f"mrope_section {list(section)} does not sum to head_dim / 2 = {d.head_dim // 2}", where)
    visual = find_prefix(names_, VISUAL_PREFIXES, "patch_embed.proj.weight", where)
    decoder = dataclasses.replace(d, mrope_section=section)
    tower = tower_of(cfg, pre, decoder.hidden, where, pre_where, image_size)
    if tower.out_hidden != decoder.hidden:
        raise ConfigError(
            f"the vision merger's output {tower.out_hidden} is not the text hidden {decoder.hidden}", where
        )
    mean, std = mean_std(tower)
    renames = tuple((c, m) for c, m in ((visual, VISUAL_MODULE), (lm, LM_MODULE)) if c != m)
    spec = Qwen2VlSpec(
        model_type=str(cfg["model_type"]),
        tower=tower,
        decoder=decoder,
        image_mean=mean,
        image_std=std,
        image_token_id=image_token,
        renames=renames,
        pinned=image_size is not None,
    )
    if not 0 <= image_token < decoder.vocab_size:
        raise ConfigError(f"image_token_id {image_token} is outside the vocabulary of {decoder.vocab_size}", where)
    return spec


class Qwen2Vl(VlmFamily):
    """Qwen2-VL / Qwen2.5-VL: its own tower and merger at one fixed side, M-RoPE in the decoder."""

    name = "qwen2_vl"
    positions = MROPE
    fallback_template = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><image><|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n"
    )

    def spec(self, cfg, model_dir, names_, pre, image_size):
        pre_path = model_dir / names.WEIGHT_FILES["preprocessor_config"]
        mean_std_of = lambda t: mean_std(pre, t, pre_path, clip=True)  # noqa: E731
        spec = qwen2_vl_spec(cfg, model_dir, names_, pre, mean_std_of, image_size)
        return check_span_fits(spec, cfg, model_dir / "config.json")

    def image_tokens(self, spec: Qwen2VlSpec) -> int:
        t, h, w = spec.tower.merged_grid
        return t * h * w

    def expected_shapes(self, spec, cfg):
        from .qwen2_vl_graph import expected_shapes

        return expected_shapes(spec)

    def build_vision(self, weights, spec):
        from .qwen2_vl_graph import build_vision

        return build_vision(weights, spec)

    def span_hint(self, spec: Qwen2VlSpec, positions: int) -> str:
        """(side / (patch * merge))^2 image tokens, the whole span: the largest side that leaves room."""
        t = spec.tower
        side = math.isqrt(max(positions - 2, 0)) * t.patch_size * t.merge_size
        return f"; the largest `image_size` that leaves room is {side}" if side else ""

    def processor_record(self, spec: Qwen2VlSpec, hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The processor pinned to the graphs' side where the caller set it (`image_size`); one fixed grid."""
        t = spec.tower
        by = "pinned by the image_size argument (--image-size); hf_image_processor is the model's own, so pinned"
        pinned = f", {by}" if spec.pinned else ""
        fixed = {
            "image_grid_thw": [1, t.grid, t.grid],
            "patch_size": t.patch_size,
            "merge_size": t.merge_size,
            "temporal_patch_size": t.temporal_patch_size,
            "note": f"every image becomes one {t.image_size}x{t.image_size} frame (the side the processor's "
            f"min_pixels/max_pixels give every square image{pinned}); patchify, the temporal copies and the vision "
            f"rotary tables are constants of {names.VISION_ENCODER}",
        }
        return spec.processor_config(hf), {"fixed_resolution": fixed}

    def hf_pixel_values(self, spec: Qwen2VlSpec, gray: np.ndarray) -> np.ndarray:
        return hf_pixel_values(spec, gray)

    def hf_image_inputs(self, spec: Qwen2VlSpec, gray: np.ndarray) -> dict[str, Any]:
        import torch

        grid = torch.tensor([[1, spec.tower.grid, spec.tower.grid]])  # the processor's grid
        return {**super().hf_image_inputs(spec, gray), "image_grid_thw": grid}

    def hf_token_inputs(self, spec: Qwen2VlSpec, ids) -> dict[str, Any]:
        """`mm_token_type_ids` (1 on the image's tokens), which `get_rope_index` needs to place M-RoPE."""
        return {"mm_token_type_ids": (ids == spec.image_token_id).int()}

    def vision_description(self, cfg: dict[str, Any], built: dict[str, Any]) -> VisionDescription | None:
        """The tower at the fixed side edgekit built (`edgekit_vlm.image_size`; None before import, which fixes
        it): every patch through the blocks, the 2 x 2 merge as the pooling (the merger takes 4 patches' width),
        the still image's temporal copies as input channels of the patch embedding. Qwen2.5-VL's SwiGLU counts
        three matrices (mlp = 1.5 x intermediate) and its windowed blocks are costed as full attention: edgekit's
        graph computes every score and masks the ones outside a window (a constant block mask), so that is what
        the engine runs; a window-by-window kernel would do 1 / windows of it."""
        v = cfg.get("vision_config") or {}
        if not v or not built.get("image_size"):
            return None
        merge = int(v.get("spatial_merge_size", 2))
        if built.get("model_type") == "qwen2_5_vl":
            hidden, mlp = int(v["hidden_size"]), int(1.5 * int(v["intermediate_size"]))
        else:
            hidden = int(v["embed_dim"])
            mlp = int(hidden * float(v.get("mlp_ratio", 4)))
        return VisionDescription(
            image_size=int(built["image_size"]),
            patch_size=int(v["patch_size"]),
            hidden=hidden,
            layers=int(built.get("tower_layers") or v["depth"]),
            mlp=mlp,
            channels=int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)),
            pool_stride=merge,
            connector_in=hidden * merge * merge,
        )


FAMILY = Qwen2Vl()
