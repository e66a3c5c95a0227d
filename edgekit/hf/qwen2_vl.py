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
`qwen2_vl_processor`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.blocks import layer_norm, linear, rms_norm, silu
from edgekit.export.decoder import apply_rope
from edgekit.export.irbuilder import GraphBuilder, scope_of
from edgekit.export.specs import DecoderSpec
from edgekit.positions import MROPE, PositionScheme

from .checkpoint import find_prefix
from .config import language_model_config, language_model_spec, rope_parameters
from .qwen2_vl_processor import check_image_size, fixed_side, pin_processor
from .spec_base import VlmSpecBase
from .vision_tower import GELU, activation, normalize_frames

F32 = ir.DataType.FLOAT
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


MLP_ROLES = {False: ("mlp.fc1", "mlp.fc2"), True: ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def vision_names(t: Qwen2VisionSpec, i: int) -> dict[str, str]:
    p = f"{t.prefix}blocks.{i}."
    return {r: p + r for r in ("norm1", "norm2", "attn.qkv", "attn.proj", *MLP_ROLES[t.v25])}


def expected_shapes(spec: Qwen2VlSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the vision graph reads, with the shape config.json implies (module names)."""
    t, p = spec.tower, spec.tower.prefix
    d, m2 = t.hidden, t.hidden * t.merge_size**2
    shapes = {f"{p}patch_embed.proj.weight": (d, t.channels, t.temporal_patch_size, t.patch_size, t.patch_size)}
    norms = ("weight",) if t.v25 else ("weight", "bias")  # Qwen2.5-VL: RMSNorm
    for i in range(t.layers):
        n = vision_names(t, i)
        for r in ("norm1", "norm2"):
            shapes.update({f"{n[r]}.{k}": (d,) for k in norms})
        shapes.update({f"{n['attn.qkv']}.weight": (3 * d, d), f"{n['attn.qkv']}.bias": (3 * d,)})
        shapes.update({f"{n['attn.proj']}.weight": (d, d), f"{n['attn.proj']}.bias": (d,)})
        *ups, down = MLP_ROLES[t.v25]
        for r in ups:
            shapes.update({f"{n[r]}.weight": (t.mlp, d), f"{n[r]}.bias": (t.mlp,)})
        shapes.update({f"{n[down]}.weight": (d, t.mlp), f"{n[down]}.bias": (d,)})
    shapes.update({f"{p}merger.ln_q.{k}": (d,) for k in norms})
    shapes.update({f"{p}merger.mlp.0.weight": (m2, m2), f"{p}merger.mlp.0.bias": (m2,)})
    shapes.update({f"{p}merger.mlp.2.weight": (t.out_hidden, m2), f"{p}merger.mlp.2.bias": (t.out_hidden,)})
    return shapes


def patch_positions(t: Qwen2VisionSpec) -> np.ndarray:
    """(patches, 2) row and column of each patch in the processor's merge-window order
    (transformers' `get_vision_position_ids` for grid (1, g, g))."""
    g, m = t.grid, t.merge_size
    hpos, wpos = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
    shape = (g // m, m, g // m, m)
    return np.stack([a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for a in (hpos, wpos)], axis=-1)


def vision_rope_tables(t: Qwen2VisionSpec) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (patches, 1, head_dim): `Qwen2VLVisionRotaryEmbedding` for the fixed grid, in float32."""
    spatial = (t.hidden // t.heads) // 2
    inv_freq = (1.0 / (np.float32(t.rope_theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))).astype(
        np.float32
    )
    freqs = patch_positions(t).astype(np.float32)[..., None] * inv_freq  # (N, 2, hd/4)
    hw = np.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)  # (N, hd/2)
    emb = np.concatenate([hw, hw], axis=-1)[:, None, :]
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def window_index(t: Qwen2VisionSpec) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's `get_vision_window_index` for the fixed grid (1, g, g): the merge units' order (windows of
    `t.window` x `t.window` units, row by row, each window's units row by row) and each unit's window id in that
    order (transformers pads the grid up to whole windows, a whole extra window when it divides; the empty ones
    hold no unit)."""
    g, w = t.grid // t.merge_size, t.window
    index = np.arange(g * g).reshape(g, g)
    pad = w - g % w
    padded = np.pad(index, ((0, pad), (0, pad)), constant_values=-100)
    n = (g + pad) // w
    padded = padded.reshape(n, w, n, w).transpose(0, 2, 1, 3).reshape(n * n, w * w)
    ids = np.repeat(np.arange(n * n), w * w).reshape(n * n, w * w)
    keep = padded != -100
    return padded[keep], ids[keep]


def _rms_or_layer_norm(b: GraphBuilder, x: ir.Value, prefix: str, t: Qwen2VisionSpec) -> ir.Value:
    return rms_norm(b, x, prefix, t.ln_eps) if t.v25 else layer_norm(b, x, prefix, t.ln_eps)


def _patches(b: GraphBuilder, x: ir.Value, t: Qwen2VisionSpec) -> ir.Value:
    """(n, C, S, S) normalised -> (n, patches, C * T * p * p): the processor's `patchify` for a still image
    (merge-window order, the frame repeated `temporal_patch_size` times), then the Conv3d as one MatMul."""
    scope = scope_of(f"{t.prefix}patch_embed")
    c, g, m, p, tt = t.channels, t.grid, t.merge_size, t.patch_size, t.temporal_patch_size
    x = b.op(scope, "Reshape", [x, b.const([-1, c, g // m, m, p, g // m, m, p])])
    x = b.op(scope, "Transpose", [x], {"perm": [0, 2, 5, 3, 6, 1, 4, 7]})  # (n, g/m, g/m, m, m, C, p, p)
    x = b.op(scope, "Reshape", [x, b.const([-1, g * g, c, 1, p * p])])
    if tt > 1:
        x = b.op(scope, "Concat", [x] * tt, {"axis": 3})
    x = b.op(scope, "Reshape", [x, b.const([-1, g * g, c * tt * p * p])])
    name = f"{t.prefix}patch_embed.proj"
    w = b.op(scope, "Reshape", [b.weight(f"{name}.weight"), b.const([t.hidden, c * tt * p * p])])
    return b.op(scope, "MatMul", [x, b.op(scope, "Transpose", [w], {"perm": [1, 0]})])


def _attention(b: GraphBuilder, x: ir.Value, t: Qwen2VisionSpec, i: int, cos, sin, mask=None) -> ir.Value:
    n = vision_names(t, i)
    scope = scope_of(n["attn.qkv"].rsplit(".", 1)[0])
    h, hd = t.heads, t.hidden // t.heads
    qkv = b.op(scope, "Reshape", [linear(b, x, n["attn.qkv"], bias=True), b.const([0, 0, 3, h, hd])])
    parts = b.op_multi(scope, "Split", [qkv], 3, {"axis": 2, "num_outputs": 3})
    q, k, v = (b.op(scope, "Squeeze", [y, b.const([2])]) for y in parts)
    q = apply_rope(b, q, cos, sin, f"{scope}/rotary_q")  # (n, N, h, hd) against (N, 1, hd)
    k = apply_rope(b, k, cos, sin, f"{scope}/rotary_k")
    q = b.op(scope, "Transpose", [q], {"perm": [0, 2, 1, 3]})
    k_t = b.op(scope, "Transpose", [k], {"perm": [0, 2, 3, 1]})
    v = b.op(scope, "Transpose", [v], {"perm": [0, 2, 1, 3]})
    scores = b.op(scope, "Div", [b.op(scope, "MatMul", [q, k_t]), b.const(math.sqrt(hd), np.float32)])
    if mask is not None:  # Qwen2.5-VL's windows: the scores outside a patch's window at float32's lowest
        scores = b.op(scope, "Add", [scores, mask])
    y = b.op(scope, "MatMul", [b.op(scope, "Softmax", [scores], {"axis": -1}), v])
    y = b.op(scope, "Reshape", [b.op(scope, "Transpose", [y], {"perm": [0, 2, 1, 3]}), b.const([0, 0, t.hidden])])
    return linear(b, y, n["attn.proj"], bias=True)


def _mlp(b: GraphBuilder, x: ir.Value, t: Qwen2VisionSpec, n: dict[str, str], scope: str) -> ir.Value:
    if not t.v25:
        y = activation(b, linear(b, x, n["mlp.fc1"], bias=True), scope, t.act)
        return linear(b, y, n["mlp.fc2"], bias=True)
    gate = silu(b, linear(b, x, n["mlp.gate_proj"], bias=True), scope_of(n["mlp.gate_proj"]))
    up = linear(b, x, n["mlp.up_proj"], bias=True)
    return linear(b, b.op(scope, "Mul", [gate, up]), n["mlp.down_proj"], bias=True)


def _window_mask(b: GraphBuilder, t: Qwen2VisionSpec, window_ids: np.ndarray) -> ir.Value:
    """(N, N) additive mask: 0 where two patches (in window order) share a window, float32's lowest elsewhere,
    from one window id per patch (the merge unit's, repeated)."""
    scope = f"{t.prefix}window_attention"
    ids = b.const(np.repeat(window_ids, t.merge_size**2).astype(np.int64))
    same = b.op(
        scope, "Equal", [b.op(scope, "Unsqueeze", [ids, b.const([1])]), b.op(scope, "Unsqueeze", [ids, b.const([0])])]
    )
    return b.op(scope, "Where", [same, b.const(0.0, np.float32), b.const(np.finfo(np.float32).min, np.float32)])


def build_vision(weights: Mapping[str, np.ndarray], spec: Qwen2VlSpec) -> ir.Model:
    """pixel_values (batch, 1, 1, S, S) display values -> image_features (batch, span, text hidden)."""
    t = spec.tower
    b = GraphBuilder(weights, "vision_encoder")
    s, c = t.image_size, t.channels
    pixels = b.input(names.PIXEL_VALUES, F32, ["batch", 1, 1, s, s])
    scope = "/image_processor"
    x = b.op(scope, "Reshape", [pixels, b.const([-1, 1, s, s])])
    x = normalize_frames(b, x, c, spec.image_mean, spec.image_std, scope)
    x = _patches(b, x, t)
    cos_np, sin_np = vision_rope_tables(t)
    units, unit_dim, mask = spec.num_image_tokens, t.hidden * t.merge_size**2, None
    if t.window:  # the window permutation of merge units, on the patches and on the rotary tables
        order, window_ids = window_index(t)
        wscope = f"{t.prefix}window_index"
        x = b.op(wscope, "Reshape", [x, b.const([0, units, unit_dim])])
        x = b.op(wscope, "Gather", [x, b.const(order)], {"axis": 1})
        x = b.op(wscope, "Reshape", [x, b.const([0, t.num_patches, t.hidden])])
        shape = (units, t.merge_size**2, 1, -1)
        cos_np, sin_np = (a.reshape(shape)[order].reshape(t.num_patches, 1, -1) for a in (cos_np, sin_np))
        mask = _window_mask(b, t, window_ids)
    cos, sin = b.const(cos_np, np.float32), b.const(sin_np, np.float32)
    for i in range(t.layers):
        n = vision_names(t, i)
        bscope = scope_of(f"{t.prefix}blocks.{i}")
        windowed = mask if t.window and i not in t.full_attention else None
        h = _rms_or_layer_norm(b, x, n["norm1"], t)
        x = b.op(bscope, "Add", [x, _attention(b, h, t, i, cos, sin, windowed)])
        x = b.op(bscope, "Add", [x, _mlp(b, _rms_or_layer_norm(b, x, n["norm2"], t), t, n, bscope)])
    merger = f"{t.prefix}merger"
    x = _rms_or_layer_norm(b, x, f"{merger}.ln_q", t)
    x = b.op(scope_of(merger), "Reshape", [x, b.const([0, units, unit_dim])])
    x = activation(b, linear(b, x, f"{merger}.mlp.0", bias=True), scope_of(merger), "none")
    x = linear(b, x, f"{merger}.mlp.2", bias=True)
    if t.window:  # back to the image's row order (transformers' argsort of the window index)
        x = b.op(scope_of(merger), "Gather", [x, b.const(np.argsort(order))], {"axis": 1})
    b.output(x, names.IMAGE_FEATURES, F32, ["batch", spec.span_length, spec.decoder.hidden])
    return b.model()
