"""What every Hugging Face VLM spec shares, whatever its family: module names over the checkpoint's layout
(`ModuleNames`) and the summary a bundle records of the model (`config.json`'s `edgekit_vlm`, `edgekit build`'s
description).

Why a base: `vlm.VlmSpec` and `qwen2_vl.Qwen2VlSpec` describe different towers but are read through one
interface by conversion, serving, parity and the build; the summary's shared fields are written here once, and
each family adds only its own (`family_summary`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .checkpoint import ModuleNames

if TYPE_CHECKING:
    from edgekit.export.specs import DecoderSpec
    from edgekit.positions import PositionScheme

    from .qwen2_vl import Qwen2VisionSpec
    from .vision_tower import VisionTowerSpec


class VlmSpecBase(ModuleNames):
    """A mixin for the frozen spec dataclasses (no fields of its own). A subclass provides `family`,
    `model_type`, `text_model_type`, `image_size`, `num_image_tokens`, `span_length`, `tower` (with `family`),
    `tower_layers` and `decoder` (with `layers`), and the span and normalisation its readers share: the type
    checker's view of them is below (each family has them as fields or properties, so no runtime attribute here)."""

    if TYPE_CHECKING:

        @property
        def family(self) -> str: ...
        @property
        def model_type(self) -> str: ...
        @property
        def text_model_type(self) -> str: ...
        @property
        def image_size(self) -> int: ...
        @property
        def num_image_tokens(self) -> int: ...
        @property
        def num_images(self) -> int: ...
        @property
        def span_length(self) -> int: ...
        @property
        def span_ids(self) -> list[int]: ...
        @property
        def wrapper_ids(self) -> list[int]: ...
        @property
        def span_before(self) -> tuple[int, ...]: ...
        @property
        def span_after(self) -> tuple[int, ...]: ...
        @property
        def split_span(self) -> tuple[int, ...]: ...
        @property
        def tiles(self) -> int: ...
        @property
        def image_token_id(self) -> int: ...
        @property
        def image_mean(self) -> tuple[float, ...]: ...
        @property
        def image_std(self) -> tuple[float, ...]: ...
        @property
        def tower(self) -> VisionTowerSpec | Qwen2VisionSpec: ...
        @property
        def tower_layers(self) -> int: ...
        @property
        def decoder(self) -> DecoderSpec: ...
        @property
        def positions(self) -> PositionScheme: ...
        @property
        def pinned(self) -> bool: ...

    def processor_config(self, pre: Mapping[str, Any] | None) -> dict[str, Any]:
        """The image processor settings that go with these graphs: the directory's own (a family whose side the
        caller can pin, Qwen2-VL's, pins them to it)."""
        return dict(pre or {})

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
