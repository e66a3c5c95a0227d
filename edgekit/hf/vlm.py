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

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names

from .config import VLM_TYPES
from .family import family_for, family_named
from .spec_base import VlmSpecBase
from .tower_family import SPAN_ROWS, span_rows
from .vlm_spec import VlmSpec, check_span_fits, preprocessor

__all__ = [
    "SPAN_ROWS",
    "VLM_TYPES",
    "VlmSpec",
    "build_vlm_vision",
    "check_span_fits",
    "expected_vlm_shapes",
    "span_rows",
    "vlm_spec",
]


def vlm_spec(
    cfg: dict[str, Any], model_dir: str | Path, names_: Collection[str], *, image_size: int | None = None
) -> VlmSpecBase:
    """A LLaVA / LLaVA-NeXT / Idefics3 / SmolVLM / Qwen2-VL config (+ the checkpoint's names, the processor files)
    -> its family's spec (`edgekit.hf.family`). `image_size` pins Qwen2-VL's dynamic resolution to that square
    side; any other family refuses it (its side is set by its own files)."""
    model_dir = Path(model_dir)
    pre = preprocessor(model_dir / names.WEIGHT_FILES["preprocessor_config"])
    return family_for(cfg["model_type"]).spec(cfg, model_dir, names_, pre, image_size)


def expected_vlm_shapes(spec: VlmSpecBase, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the vision graph reads, with the shape config.json implies (the decoder's come from
    `convert.expected_decoder_shapes`)."""
    return family_named(spec.family).expected_shapes(spec, cfg)


def build_vlm_vision(weights: Mapping[str, np.ndarray], spec: VlmSpecBase) -> ir.Model:
    """pixel_values (batch, 1, 1, S, S) display values -> image_features (batch, span, text_hidden)."""
    return family_named(spec.family).build_vision(weights, spec)
