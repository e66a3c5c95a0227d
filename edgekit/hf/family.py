"""The contract one Hugging Face VLM family keeps, and the registry that finds a family by its `model_type`.

Why a contract: conversion, serving, parity and the cost models used to branch on `family == "..."` in thirty
places; a new family meant editing each. Now each family is one module (`llava`, `llava_next`, `idefics3`,
`qwen2_vl`) with one `FAMILY` object that answers every question the rest of edgekit asks of it: its spec from the
directory's files, the tensors it reads, its vision graph, the preprocessing a bundle records, what transformers
takes for the parity check, and its `ModelDescription`'s vision part. Adding a family is its module and one line in
`FAMILY_MODULES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.model_description import TEXT, VisionDescription

# family name (what a bundle records in `edgekit_vlm.family`) -> its module
FAMILY_MODULES = {
    "llava": "edgekit.hf.llava",
    "llava_next": "edgekit.hf.llava_next",
    "idefics3": "edgekit.hf.idefics3",
    "qwen2_vl": "edgekit.hf.qwen2_vl",
}
# Hugging Face `model_type` -> family (SmolVLM is Idefics3's architecture; Qwen2.5-VL is built by Qwen2-VL's)
MODEL_TYPES = {
    "llava": "llava",
    "llava_next": "llava_next",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
}


class VlmFamily:
    """One VLM family. The defaults are what most families do; a family overrides what it does differently."""

    name: str = ""
    positions: str = TEXT  # the decoder's position scheme (Qwen2-VL: M-RoPE)
    fallback_template: str = ""  # the chat turn used when the directory has no chat template (`{prompt}`, `<image>`)

    def spec(
        self,
        cfg: dict[str, Any],
        model_dir: Path,
        names_: Collection[str],
        pre: dict[str, Any] | None,
        image_size: int | None,
    ) -> Any:
        """config.json (+ the checkpoint's tensor names, preprocessor_config.json as `pre`) -> the family's spec."""
        raise NotImplementedError

    def image_tokens(self, spec) -> int:
        """How many image tokens the processor writes for one image."""
        raise NotImplementedError

    def expected_shapes(self, spec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Every tensor the vision graph reads, with the shape config.json implies."""
        raise NotImplementedError

    def build_vision(self, weights: Mapping[str, np.ndarray], spec) -> ir.Model:
        """pixel_values (batch, 1, 1, S, S) display values -> image_features (batch, span, text_hidden)."""
        raise NotImplementedError

    def span_hint(self, spec, positions: int) -> str:
        """What to say when the image span leaves no room in `positions` (appended to the refusal)."""
        return ""

    def processor_record(self, spec, hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the model's image processor settings as the bundle records them, the bundle's own notes on how the
        vision graph follows that processor)."""
        return hf, {}

    def hf_pixel_values(self, spec, gray: np.ndarray) -> np.ndarray:
        """(S, S) in [0, 1] -> transformers' pixel_values for one image."""
        raise NotImplementedError

    def hf_image_inputs(self, spec, gray: np.ndarray) -> dict[str, Any]:
        """The image keyword arguments transformers' model takes for one frame."""
        import torch

        return {"pixel_values": torch.tensor(self.hf_pixel_values(spec, gray))}

    def hf_token_inputs(self, spec, ids) -> dict[str, Any]:
        """What else transformers' model takes with `input_ids` (none by default)."""
        return {}

    def vision_description(self, cfg: dict[str, Any], built: dict[str, Any]) -> VisionDescription | None:
        """The tower as the cost models count it, from a bundle's config.json (`built`: its `edgekit_vlm` summary).
        None where the directory does not fix it (a Qwen2-VL directory before import has no fixed side)."""
        raise NotImplementedError


def family_named(name: str) -> VlmFamily:
    """A family by its name (`edgekit_vlm.family`, a spec's `family`)."""
    if name not in FAMILY_MODULES:
        raise ConfigError(f"unknown VLM family {name!r} (edgekit builds {', '.join(FAMILY_MODULES)})")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY


def family_for(model_type: str) -> VlmFamily:
    """A family by the Hugging Face `model_type` its config.json names."""
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a VLM edgekit builds ({', '.join(MODEL_TYPES)})")
    return family_named(MODEL_TYPES[model_type])


def family_of(spec) -> VlmFamily | None:
    """The family of a spec; None for a spec with none (a decoder alone, fine-tuning's text-only spec)."""
    name = getattr(spec, "family", None)
    return family_named(name) if name in FAMILY_MODULES else None
