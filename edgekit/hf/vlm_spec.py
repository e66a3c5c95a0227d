"""The spec of a VLM built from a vision tower and a connector (LLaVA, LLaVA-NeXT, Idefics3 / SmolVLM), and the
readers every family's spec shares: the language model's config, the processor's normalisation and files, the
split span's tokens, and the check that an image span leaves the decoder room.

Why apart from the families: each family module fills a `VlmSpec` its own way (`edgekit.hf.family`); what they
fill, and the readers they fill it with, are written here once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.export.specs import DecoderSpec
from edgekit.positions import PositionScheme

from .config import check_full_window, language_model_config, read_config_file
from .family import family_named
from .spec_base import VlmSpecBase
from .vision_tower import VisionTowerSpec

TEXT_TYPES = ("llama", "mistral", "qwen2")
# the processors' defaults when preprocessor_config.json does not say (CLIPImageProcessor; SigLIP / Idefics3)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
MeanStd = Callable[[Any], tuple[tuple[float, ...], ...]]


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
    # split: the downscaled whole frame goes before the crops (LLaVA-NeXT's base image), else after them
    # (Idefics3's global image)
    whole_image_first: bool = False

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
    def num_image_tokens(self) -> int:
        """How many `image_token_id` tokens the processor writes for one image (the family's count)."""
        return family_named(self.family).image_tokens(self)

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


def text_config(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    text = dict(cfg.get("text_config") or {})
    mt = text.get("model_type", "llama")
    if mt not in TEXT_TYPES:
        raise ConfigError(
            f"text_config.model_type {mt!r} is not supported (edgekit builds {', '.join(TEXT_TYPES)})", where
        )
    if mt == "mistral":
        check_full_window(text, where, "text_config.")
        text["model_type"] = "llama"
    return {**text, "_source_model_type": mt}


def mean_std(
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


def preprocessor(path: Path) -> dict[str, Any] | None:
    """The directory's preprocessor_config.json (None: absent), read once for every field the spec takes."""
    return read_config_file(path) if path.is_file() else None


def check_span_fits(spec: VlmSpecBase, cfg: dict[str, Any], where: Path):
    """Refuse, before any graph is written, an image span that leaves the decoder no room for a prompt and a
    report: such a bundle would build and then refuse every report (edgekit.reporter.ContextBudget). For a
    Qwen2-VL side pinned too large (`image_size`), the line names the largest side that fits. Returns `spec`."""
    positions = language_model_config(cfg).get("max_position_embeddings")
    if isinstance(positions, bool) or not isinstance(positions, int) or spec.span_length + 2 <= positions:
        return spec
    hint = family_named(spec.family).span_hint(spec, positions)
    raise ConfigError(
        f"one image takes {spec.span_length} decoder positions and text_config.max_position_embeddings is "
        f"{positions}: no room is left for a prompt and a report{hint}",
        where,
    )
