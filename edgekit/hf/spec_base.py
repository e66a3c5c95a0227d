"""What every Hugging Face VLM spec shares, whatever its family: module names over the checkpoint's layout
(`ModuleNames`) and the summary a bundle records of the model (`config.json`'s `edgekit_vlm`, `edgekit build`'s
description).

Why a base: `vlm.VlmSpec` and `qwen2_vl.Qwen2VlSpec` describe different towers but are read through one
interface by conversion, serving, parity and the build; the summary's shared fields are written here once, and
each family adds only its own (`family_summary`).
"""

from __future__ import annotations

from typing import Any

from .checkpoint import ModuleNames


class VlmSpecBase(ModuleNames):
    """A mixin for the frozen spec dataclasses (no fields of its own). A subclass provides `family`,
    `model_type`, `text_model_type`, `image_size`, `num_image_tokens`, `span_length`, `tower` (with `family`),
    `tower_layers` and `decoder` (with `layers`)."""

    def to_dict(self) -> dict[str, Any]:
        """The model's summary: the fields every family has, then the family's own."""
        return {
            "family": self.family,
            "model_type": self.model_type,
            "text_model_type": self.text_model_type,
            "image_size": self.image_size,
            "image_tokens": self.num_image_tokens,
            "span_tokens": self.span_length,
            "tower": self.tower.family,
            "tower_layers": self.tower_layers,
            "decoder_layers": self.decoder.layers,
            **self.family_summary(),
        }

    def family_summary(self) -> dict[str, Any]:
        """The summary's fields only this family has (none by default)."""
        return {}
