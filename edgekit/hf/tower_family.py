"""What the families built from a vision tower and a connector share (LLaVA, LLaVA-NeXT, Idefics3 / SmolVLM):
the spec's common reading, the vision graph around the family's connector, the image span's wrapper tokens, the
parity check's pixel values and the tower as the cost models count it.

Why a base class: these three differ only in how the tower's states become image tokens (`project`), which tensors
that reads (`connector_shapes`) and a few spec fields (`fields`); the rest is one path, written once here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.irbuilder import GraphBuilder
from edgekit.model_description import VisionDescription

from .checkpoint import SafetensorsCheckpoint
from .family import VlmFamily
from .frame_split import split_frame, split_frame_np
from .qwen2_vl_processor import image_size_refused
from .spec_base import VlmSpecBase
from .vision_tower import expected_tower_shapes, hidden_states, normalize_frames
from .vlm_spec import VlmSpec, check_span_fits, mean_std, text_config

F32 = ir.DataType.FLOAT
SPAN_ROWS = "image_span_embeddings"  # initializer name of the span's token embeddings inside the vision graph


class TowerFamily(VlmFamily):
    """A vision tower read at some layers, a connector into the language model, the span's wrapper tokens."""

    clip_defaults = False  # the processor's class defaults are CLIP's whatever the tower (LlavaNextImageProcessor)

    def fields(
        self,
        cfg: dict[str, Any],
        model_dir: Path,
        names_: Collection[str],
        pre: dict[str, Any] | None,
        text: dict[str, Any],
        image_token: int,
    ) -> dict[str, Any]:
        """The spec's fields this family fills: its tower, connector, decoder and span."""
        raise NotImplementedError

    def finish(self, spec: VlmSpec, where: Path) -> VlmSpec:
        """The family's last checks and renames on the whole spec."""
        return spec

    def spec(self, cfg, model_dir, names_, pre, image_size):
        where = model_dir / "config.json"
        if image_size is not None:
            raise image_size_refused(cfg["model_type"], where)
        text = text_config(cfg, where)
        source_text_type = text.pop("_source_model_type")
        image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
        if isinstance(image_token, bool) or not isinstance(image_token, int):
            raise ConfigError(f"image_token_id: expected an int, got {image_token!r}", where)
        fields = self.fields(cfg, model_dir, names_, pre, text, image_token)
        pre_path = model_dir / names.WEIGHT_FILES["preprocessor_config"]
        mean, std = mean_std(pre, fields["tower"], pre_path, clip=self.clip_defaults)
        spec = VlmSpec(
            family=self.name,
            model_type=cfg["model_type"],
            text_model_type=source_text_type,
            image_mean=mean,
            image_std=std,
            image_token_id=image_token,
            **fields,
        )
        if not 0 <= image_token < spec.decoder.vocab_size:
            raise ConfigError(
                f"image_token_id {image_token} is outside the vocabulary of {spec.decoder.vocab_size}", where
            )
        return self.finish(check_span_fits(spec, cfg, where), where)

    def image_tokens(self, spec: VlmSpec) -> int:
        return spec.num_images * spec.tower.num_patches // (spec.scale_factor**2)

    def connector_shapes(self, spec: VlmSpec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def expected_shapes(self, spec: VlmSpec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        t = spec.tower
        vcfg = cfg.get("vision_config") or {}
        shapes = expected_tower_shapes(t, spec.tower_layers, int(vcfg.get("intermediate_size", 4 * t.hidden)))
        return {**shapes, **self.connector_shapes(spec, cfg)}

    def project(self, b: GraphBuilder, states: list[ir.Value], spec: VlmSpec) -> ir.Value:
        """The tower's hidden states -> the image features (tower inputs, tokens, text hidden)."""
        raise NotImplementedError

    def build_vision(self, weights: Mapping[str, np.ndarray], spec: VlmSpec) -> ir.Model:
        b = GraphBuilder(weights, "vision_encoder")
        s, c = spec.image_size, spec.tower.channels
        pixels = b.input(names.PIXEL_VALUES, F32, ["batch", 1, 1, s, s])
        scope = "/image_processor"
        x = b.op(scope, "Reshape", [pixels, b.const([-1, 1, s, s])])
        if spec.tiles:  # the processor's crops and its whole image downscaled, each one tower input
            x = split_frame(b, x, spec.tiles, spec.tower.image_size, spec.whole_image_first)
        x = normalize_frames(b, x, c, spec.image_mean, spec.image_std, scope)
        y = self.project(b, hidden_states(b, x, spec.tower, spec.tower_layers), spec)
        if spec.split_span:
            y = _split_span_features(b, y, pixels, spec)
        elif spec.span_before or spec.span_after:
            y = _wrap_span(b, y, pixels, spec)
        b.output(y, names.IMAGE_FEATURES, F32, ["batch", spec.span_length, spec.decoder.hidden])
        return b.model()

    def hf_pixel_values(self, spec: VlmSpec, gray: np.ndarray) -> np.ndarray:
        """Split (Idefics3 tiles, LLaVA-NeXT anyres): (1, r*r + 1, C, M, M), the crops and the whole image as the
        vision graph cuts them; else (1, 1, C, S, S)."""
        c = spec.tower.channels
        mean = np.asarray(spec.image_mean, np.float32)[:, None, None]
        std = np.asarray(spec.image_std, np.float32)[:, None, None]
        if spec.tiles:
            images = split_frame_np(gray, spec.tiles, spec.tower.image_size, spec.whole_image_first)
            return ((np.repeat(images[:, None], c, axis=1) - mean) / std)[None].astype(np.float32)
        return ((np.repeat(gray[None], c, axis=0) - mean) / std)[None, None].astype(np.float32)

    def vision_description(self, cfg: dict[str, Any], built: dict[str, Any]) -> VisionDescription | None:
        v = cfg.get("vision_config") or {}
        if not v:
            return None
        sf = self.pooling(cfg)
        hidden = int(v["hidden_size"])
        vision = VisionDescription(
            image_size=int(v["image_size"]),
            patch_size=int(v["patch_size"]),
            hidden=hidden,
            layers=int(built.get("tower_layers") or v["num_hidden_layers"]),
            mlp=int(v["intermediate_size"]),
            channels=int(v.get("num_channels", 3)),
            pool_stride=sf,
            connector_in=hidden * sf * sf,
            tiles=(split["rows"] * split["cols"] + 1) if (split := built.get("image_splitting")) else 1,
        )
        counted = built.get("image_tokens")  # the import's own count (LLaVA-NeXT adds a newline per row)
        if isinstance(counted, int) and counted > vision.image_tokens:
            vision = dataclasses.replace(vision, extra_tokens=counted - vision.image_tokens)
        return vision

    def pooling(self, cfg: dict[str, Any]) -> int:
        """The spatial pooling of the patch grid before the connector, as the cost models count it."""
        return 1


def span_rows(spec: VlmSpecBase, ckpt: SafetensorsCheckpoint) -> dict[str, np.ndarray]:
    """The embedding rows of the span's wrapper tokens, read from the checkpoint (a few rows, not the table)."""
    ids = spec.wrapper_ids
    if not ids:
        return {}
    return {SPAN_ROWS: ckpt.read_rows(spec.to_checkpoint(f"{spec.decoder.embed_tokens}.weight"), ids)}


def _wrap_span(b: GraphBuilder, y: ir.Value, pixels: ir.Value, spec: VlmSpec) -> ir.Value:
    """(batch, tokens, hidden) image features -> the span: the wrapper tokens' embeddings before and after."""
    rows = b.weight(SPAN_ROWS)  # (before + after, hidden)
    batch = b.op("/image_span", "Shape", [pixels], {"start": 0, "end": 1})
    nb = len(spec.span_before)
    parts: list[ir.Value | None] = []
    for lo, hi in ((0, nb), (nb, nb + len(spec.span_after))):
        if hi > lo:
            part = b.op("/image_span", "Slice", [rows, b.const([lo]), b.const([hi]), b.const([0])])
            part = b.op("/image_span", "Unsqueeze", [part, b.const([0])])
            shape = b.op("/image_span", "Concat", [batch, b.const([hi - lo, spec.decoder.hidden])], {"axis": 0})
            parts.append(b.op("/image_span", "Expand", [part, shape]))
        else:
            parts.append(None)
    return b.op("/image_span", "Concat", [p for p in (parts[0], y, parts[1]) if p is not None], {"axis": 1})


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
