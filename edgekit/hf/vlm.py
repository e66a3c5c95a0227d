"""Whole vision-language models from a Hugging Face directory: LLaVA, LLaVA-NeXT, Idefics3 and SmolVLM (and,
through `qwen2_vl`, Qwen2-VL / Qwen2.5-VL at one fixed resolution) into edgekit's three graphs, the same layout
radreport-tiny ships (`vision_encoder`, `embed_tokens`, `decoder_model_merged`), so passes, targets, bundles,
`edgekit run` and edgekitd take them unchanged.

The vision graph takes what edgekit's preprocessing gives every model — display frames in [0, 1] as
`pixel_values` (batch, 1 frame, 1 channel, S, S) — and does the rest of the Hugging Face image processor's work
itself: grey to the tower's channels and the processor's per-channel `(x - image_mean) / image_std`. It returns
the whole image span the processor would put in the prompt (LLaVA: the projected image tokens; Idefics3: those
tokens between its wrapper tokens' embeddings), which the runtime places at the prompt's image slot. The decoder
is the language model's (LLaMA, Mistral or Qwen2; Qwen2-VL's with M-RoPE) through the same builders as a plain
decoder import.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.irbuilder import GraphBuilder
from edgekit.export.specs import DecoderSpec
from edgekit.positions import PositionScheme

from . import idefics3, llava, llava_next, qwen2_vl
from .checkpoint import SafetensorsCheckpoint
from .config import VLM_TYPES, language_model_config, language_model_spec, read_config_file
from .frame_split import split_frame
from .qwen2_vl_processor import image_size_refused
from .spec_base import VlmSpecBase
from .vision_tower import VisionTowerSpec, expected_tower_shapes, hidden_states, normalize_frames

__all__ = ["VLM_TYPES", "VlmSpec", "build_vlm_vision", "expected_vlm_shapes", "vlm_spec"]
TEXT_TYPES = ("llama", "mistral", "qwen2")
F32 = ir.DataType.FLOAT
# the processors' defaults when preprocessor_config.json does not say (CLIPImageProcessor; SigLIP / Idefics3)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class VlmSpec(VlmSpecBase):
    """What the three graphs of one VLM need: the tower, how its output becomes image tokens, the decoder."""

    family: str  # "llava" | "llava_next" | "idefics3" (smolvlm is idefics3's architecture)
    model_type: str
    tower: VisionTowerSpec
    tower_layers: int  # layers built (up to the deepest one read)
    connector_prefix: str
    decoder: DecoderSpec
    text_model_type: str
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    image_token_id: int
    feature_layers: tuple[int, ...] = ()  # llava: indices into hidden_states
    drop_first: bool = False  # llava 'default' strategy: the CLS token is dropped
    connector_bias: bool = True
    connector_act: str = "none"
    scale_factor: int = 1  # idefics3: pixel shuffle
    tiles: int = 0  # idefics3 image splitting / llava_next anyres: tiles per side of the square frame (0: not split)
    split_span: tuple[int, ...] = ()  # idefics3 image splitting: the whole span's ids, from the model's tokenizer
    span_before: tuple[int, ...] = ()  # token ids the processor writes before the image tokens
    span_after: tuple[int, ...] = ()
    # (checkpoint prefix, module prefix): the graph names weights as transformers' modules are named (what PEFT
    # adapters and quantization reports say), where the checkpoint on disk uses another layout (LLaVA's legacy one)
    renames: tuple[tuple[str, str], ...] = ()
    newline: str = ""  # llava_next: the checkpoint's image_newline tensor

    @property
    def positions(self) -> PositionScheme:
        """One text position per token (Qwen2-VL's spec answers M-RoPE here)."""
        return PositionScheme()

    @property
    def pinned(self) -> bool:
        """Whether the caller chose the side (`image_size`): only Qwen2-VL's dynamic resolution can be pinned."""
        return False

    @property
    def image_size(self) -> int:
        """The side of the square frame the vision graph takes (split: the tiles' whole image)."""
        return self.tower.image_size * self.tiles if self.tiles else self.tower.image_size

    @property
    def num_images(self) -> int:
        """Tower inputs per frame: the tiles and the global image when split, else 1."""
        return self.tiles * self.tiles + 1 if self.tiles else 1

    @property
    def whole_image_first(self) -> bool:
        """Split: the downscaled whole frame goes before the crops (LLaVA-NeXT's base image), else after them
        (Idefics3's global image)."""
        return self.family == "llava_next"

    @property
    def num_image_tokens(self) -> int:
        """How many `image_token_id` tokens the processor writes for one image."""
        if self.family == "llava":
            return self.tower.num_tokens - (1 if self.drop_first else 0)
        if self.family == "llava_next":
            return llava_next.num_image_tokens(self)
        return self.num_images * self.tower.num_patches // (self.scale_factor**2)

    @property
    def span_ids(self) -> list[int]:
        """The image span as token ids, what transformers' processor puts in `input_ids` for one image."""
        if self.split_span:
            return list(self.split_span)
        return [*self.span_before, *[self.image_token_id] * self.num_image_tokens, *self.span_after]

    @property
    def wrapper_ids(self) -> list[int]:
        """The span's tokens that are not image features, in order: their embedding rows live in the vision graph."""
        if self.split_span:
            return [t for t in self.split_span if t != self.image_token_id]
        return [*self.span_before, *self.span_after]

    @property
    def span_length(self) -> int:
        return len(self.span_ids)

    def family_summary(self) -> dict[str, Any]:
        return {"image_splitting": {"rows": self.tiles, "cols": self.tiles}} if self.tiles else {}


def _text_config(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    text = dict(cfg.get("text_config") or {})
    mt = text.get("model_type", "llama")
    if mt not in TEXT_TYPES:
        raise ConfigError(
            f"text_config.model_type {mt!r} is not supported (edgekit builds {', '.join(TEXT_TYPES)})", where
        )
    if mt == "mistral":  # LLaMA's math; a sliding window shorter than the context would attend differently
        window, ctx = text.get("sliding_window"), text.get("max_position_embeddings")
        if window is not None and (ctx is None or window < ctx):
            raise ConfigError(
                f"text_config.sliding_window {window} is shorter than max_position_embeddings {ctx}; "
                "edgekit's decoder attends over the whole cache",
                where,
            )
        text["model_type"] = "llama"
    return {**text, "_source_model_type": mt}


def _mean_std(
    pre: dict[str, Any] | None, tower: VisionTowerSpec, where: Path, clip: bool = False
) -> tuple[tuple[float, ...], ...]:
    """The processor's per-channel normalisation (`pre`: its preprocessor_config.json, None when absent).
    `clip`: the processor's class defaults are CLIP's whatever the tower (LlavaNextImageProcessor's)."""
    default = (CLIP_MEAN, CLIP_STD) if clip or tower.family == "clip" else (HALF, HALF)
    if pre is None:
        return default
    mean, std = pre.get("image_mean", default[0]), pre.get("image_std", default[1])
    mean = (float(mean),) * tower.channels if isinstance(mean, (int, float)) else tuple(float(x) for x in mean)
    std = (float(std),) * tower.channels if isinstance(std, (int, float)) else tuple(float(x) for x in std)
    if len(mean) != tower.channels or len(std) != tower.channels or min(std) <= 0:
        raise ConfigError(f"image_mean/image_std must give {tower.channels} values (std > 0)", where)
    return mean, std


def _preprocessor(path: Path) -> dict[str, Any] | None:
    """The directory's preprocessor_config.json (None: absent), read once for every field the spec takes."""
    return read_config_file(path) if path.is_file() else None


def _split_span(model_dir: Path, tiles: int, seq_len: int, image_token: int) -> tuple[int, ...]:
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
    ids = tuple(tokenizer.encode(idefics3.split_span_text(tiles, seq_len), add_special_tokens=False).ids)
    runs, run = [], 0
    for t in (*ids, None):
        if t == image_token:
            run += 1
        elif run:
            runs, run = [*runs, run], 0
    if runs != [seq_len] * (tiles * tiles + 1):
        raise ConfigError(
            f"the tokenizer does not give image_token_id {image_token} for each of the processor's "
            f"{tiles * tiles + 1} x {seq_len} {idefics3.IMAGE_TOKEN} tokens",
            path,
        )
    return ids


def _special_id(model_dir: Path, token: str) -> int | None:
    """A special token's id from tokenizer.json's added tokens (None when the tokenizer does not have it)."""
    path = model_dir / names.WEIGHT_FILES["tokenizer"]
    if not path.is_file():
        return None
    try:
        added = json.loads(path.read_text()).get("added_tokens", [])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError("not valid JSON", path) from None
    return next((int(t["id"]) for t in added if t.get("content") == token), None)


def vlm_spec(
    cfg: dict[str, Any], model_dir: str | Path, names_: Collection[str], *, image_size: int | None = None
) -> VlmSpec:
    """A LLaVA / LLaVA-NeXT / Idefics3 / SmolVLM / Qwen2-VL config (+ the checkpoint's names, the processor files)
    -> VlmSpec. `image_size` pins Qwen2-VL's dynamic resolution to that square side; any other family refuses it
    (its side is set by its own files)."""
    model_dir = Path(model_dir)
    where = model_dir / "config.json"
    mt = cfg["model_type"]
    pre_path = model_dir / names.WEIGHT_FILES["preprocessor_config"]
    pre = _preprocessor(pre_path)
    if mt in ("qwen2_vl", "qwen2_5_vl"):  # their own spec: a vision transformer and merger, M-RoPE in the decoder
        mean_std = lambda t: _mean_std(pre, t, pre_path, clip=True)  # noqa: E731
        return check_span_fits(qwen2_vl.qwen2_vl_spec(cfg, model_dir, names_, pre, mean_std, image_size), cfg, where)
    if image_size is not None:
        raise image_size_refused(mt, where)
    text = _text_config(cfg, where)
    source_text_type = text.pop("_source_model_type")
    image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if isinstance(image_token, bool) or not isinstance(image_token, int):
        raise ConfigError(f"image_token_id: expected an int, got {image_token!r}", where)
    if mt in ("llava", "llava_next"):
        tower = llava.tower_of(cfg, names_, where)
        layers = llava.feature_layers(cfg, tower, where)
        drop = llava.select_strategy(cfg, where)
        common = dict(
            family=mt,
            tower=tower,
            tower_layers=max(layers),
            connector_prefix=llava.projector_prefix(names_, where),
            decoder=language_model_spec(text, model_dir, names_, llava.LM_PREFIXES)[0],
            feature_layers=layers,
            drop_first=drop,
            connector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            connector_act=llava.projector_act(cfg, where),
        )
        if mt == "llava_next":
            common["tiles"] = llava_next.grid_side(cfg, pre, tower, where, pre_path)
            common["newline"] = llava_next.newline_name(names_, where)
    else:
        tower = idefics3.tower_of(cfg, names_, where)
        if not np.array_equal(idefics3.position_ids(tower), np.arange(tower.num_patches)):
            raise ConfigError("the vision tower's patch position ids are not the identity for a full image", where)
        fake, glob = (_special_id(model_dir, t) for t in (idefics3.FAKE_TOKEN, idefics3.GLOBAL_TOKEN))
        sf = idefics3.scale_factor(cfg, tower, where)
        tiles = idefics3.split_tiles(pre, tower, pre_path)
        split = _split_span(model_dir, tiles, tower.num_patches // sf**2, image_token) if tiles else ()
        common = dict(
            family="idefics3",
            tower=tower,
            tower_layers=tower.layers,
            connector_prefix=idefics3.connector_prefix(names_, where),
            decoder=language_model_spec(text, model_dir, names_, idefics3.LM_PREFIXES)[0],
            scale_factor=sf,
            span_before=tuple(t for t in (fake, glob) if t is not None),
            span_after=(fake,) if fake is not None else (),
            tiles=tiles,
            split_span=split,
        )
    mean, std = _mean_std(pre, tower, pre_path, clip=mt == "llava_next")
    spec = VlmSpec(
        model_type=mt,
        text_model_type=source_text_type,
        image_mean=mean,
        image_std=std,
        image_token_id=image_token,
        **common,
    )
    if not 0 <= image_token < spec.decoder.vocab_size:
        raise ConfigError(f"image_token_id {image_token} is outside the vocabulary of {spec.decoder.vocab_size}", where)
    if spec.family == "llava_next":
        llava_next.check_tokens(spec, where)
    check_span_fits(spec, cfg, where)
    return _module_names(spec) if spec.family in ("llava", "llava_next") else spec


def check_span_fits(spec: VlmSpec | qwen2_vl.Qwen2VlSpec, cfg: dict[str, Any], where: Path):
    """Refuse, before any graph is written, an image span that leaves the decoder no room for a prompt and a
    report: such a bundle would build and then refuse every report (edgekit.reporter.ContextBudget). For a
    Qwen2-VL side pinned too large (`image_size`), the line names the largest side that fits. Returns `spec`."""
    positions = language_model_config(cfg).get("max_position_embeddings")
    if isinstance(positions, bool) or not isinstance(positions, int) or spec.span_length + 2 <= positions:
        return spec
    hint = ""
    if spec.family == "qwen2_vl":  # (side / (patch * merge))^2 image tokens, the whole span
        t = spec.tower
        side = math.isqrt(max(positions - 2, 0)) * t.patch_size * t.merge_size
        hint = f"; the largest `image_size` that leaves room is {side}" if side else ""
    raise ConfigError(
        f"one image takes {spec.span_length} decoder positions and text_config.max_position_embeddings is "
        f"{positions}: no room is left for a prompt and a report{hint}",
        where,
    )


LLAVA_MODULES = {"tower": "model.vision_tower.", "connector": "model.multi_modal_projector."}
LLAVA_LM, LLAVA_HEAD = "model.language_model.", "lm_head"


def _module_names(spec: VlmSpec) -> VlmSpec:
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
        pairs.append((spec.newline, llava_next.NEWLINE_MODULE))
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


def expected_vlm_shapes(spec: VlmSpec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the vision graph reads, with the shape config.json implies (the decoder's come from
    `convert.expected_decoder_shapes`)."""
    if spec.family == "qwen2_vl":
        return qwen2_vl.expected_shapes(spec)
    vcfg = cfg.get("vision_config") or {}
    t, h = spec.tower, spec.decoder.hidden
    shapes = expected_tower_shapes(t, spec.tower_layers, int(vcfg.get("intermediate_size", 4 * t.hidden)))
    if spec.family in ("llava", "llava_next"):
        in_dim = t.hidden * len(spec.feature_layers)
        shapes.update(llava.projector_shapes(spec.connector_prefix, in_dim, h, spec.connector_bias))
        if spec.family == "llava_next":
            shapes[llava_next.NEWLINE_MODULE] = (h,)
    else:
        shapes[f"{t.name('final')}.weight"] = shapes[f"{t.name('final')}.bias"] = (t.hidden,)
        shapes.update(idefics3.connector_shapes(spec.connector_prefix, t, spec.scale_factor, h))
    return shapes


SPAN_ROWS = "image_span_embeddings"  # initializer name of the span's token embeddings inside the vision graph


def span_rows(spec: VlmSpec, ckpt: SafetensorsCheckpoint) -> dict[str, np.ndarray]:
    """The embedding rows of the span's wrapper tokens, read from the checkpoint (a few rows, not the table)."""
    ids = spec.wrapper_ids
    if not ids:
        return {}
    return {SPAN_ROWS: ckpt.read_rows(spec.to_checkpoint(f"{spec.decoder.embed_tokens}.weight"), ids)}


def build_vlm_vision(weights: Mapping[str, np.ndarray], spec: VlmSpec) -> ir.Model:
    """pixel_values (batch, 1, 1, S, S) display values -> image_features (batch, span, text_hidden)."""
    if spec.family == "qwen2_vl":
        return qwen2_vl.build_vision(weights, spec)
    b = GraphBuilder(weights, "vision_encoder")
    s, c = spec.image_size, spec.tower.channels
    pixels = b.input(names.PIXEL_VALUES, F32, ["batch", 1, 1, s, s])
    scope = "/image_processor"
    x = b.op(scope, "Reshape", [pixels, b.const([-1, 1, s, s])])
    if spec.tiles:  # the processor's crops and its whole image downscaled, each one tower input
        x = split_frame(b, x, spec.tiles, spec.tower.image_size, spec.whole_image_first)
    x = normalize_frames(b, x, c, spec.image_mean, spec.image_std, scope)
    states = hidden_states(b, x, spec.tower, spec.tower_layers)
    if spec.family in ("llava", "llava_next"):
        y = llava.select_and_project(b, states, spec)
        if spec.family == "llava_next":
            y = llava_next.pack(b, y, spec)
    else:
        y = idefics3.pixel_shuffle_project(b, idefics3.tower_output(b, states, spec), spec)
    if spec.split_span:
        y = _split_span_features(b, y, pixels, spec)
    elif spec.span_before or spec.span_after:
        rows = b.weight(SPAN_ROWS)  # (before + after, hidden)
        batch = b.op("/image_span", "Shape", [pixels], {"start": 0, "end": 1})
        nb = len(spec.span_before)
        parts = []
        for lo, hi in ((0, nb), (nb, nb + len(spec.span_after))):
            if hi > lo:
                part = b.op("/image_span", "Slice", [rows, b.const([lo]), b.const([hi]), b.const([0])])
                part = b.op("/image_span", "Unsqueeze", [part, b.const([0])])
                shape = b.op("/image_span", "Concat", [batch, b.const([hi - lo, spec.decoder.hidden])], {"axis": 0})
                parts.append(b.op("/image_span", "Expand", [part, shape]))
            else:
                parts.append(None)
        y = b.op("/image_span", "Concat", [p for p in (parts[0], y, parts[1]) if p is not None], {"axis": 1})
    b.output(y, names.IMAGE_FEATURES, F32, ["batch", spec.span_length, spec.decoder.hidden])
    return b.model()


def _split_span_features(b: GraphBuilder, y: ir.Value, pixels: ir.Value, spec: VlmSpec) -> ir.Value:
    """(batch * images, N, hidden) tower features -> the split span (batch, span, hidden): the runs of the span's
    wrapper tokens (their rows, in span order, in SPAN_ROWS) between the images' features, tiles then global."""
    scope, hidden = "/image_span", spec.decoder.hidden
    per = spec.num_image_tokens // spec.num_images
    y = b.op(scope, "Reshape", [y, b.const([-1, spec.num_image_tokens, hidden])])
    rows = b.weight(SPAN_ROWS)
    batch = b.op(scope, "Shape", [pixels], {"start": 0, "end": 1})
    parts, row, image, i, ids = [], 0, 0, 0, spec.split_span
    while i < len(ids):
        j = i
        while j < len(ids) and (ids[j] == spec.image_token_id) == (ids[i] == spec.image_token_id):
            j += 1
        if ids[i] == spec.image_token_id:  # one image's features (the tokenizer check made each run `per` long)
            parts.append(b.op(scope, "Slice", [y, b.const([image * per]), b.const([(image + 1) * per]), b.const([1])]))
            image += 1
        else:
            part = b.op(scope, "Slice", [rows, b.const([row]), b.const([row + j - i]), b.const([0])])
            shape = b.op(scope, "Concat", [batch, b.const([j - i, hidden])], {"axis": 0})
            parts.append(b.op(scope, "Expand", [b.op(scope, "Unsqueeze", [part, b.const([0])]), shape]))
            row += j - i
        i = j
    return b.op(scope, "Concat", parts, {"axis": 1})
