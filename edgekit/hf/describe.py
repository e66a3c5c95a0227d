"""A Hugging Face `config.json` as a `ModelDescription`: the language model's shape through the one config reader,
the vision tower through its family (`edgekit.hf.family`).

Why here and not in each cost model: the X1 and Orin cost models both read imported models, and the Orin estimate
used to read `vision_config` itself, branching on the family; a bundle's config.json (with the `edgekit_vlm`
summary the import wrote) or a model directory's is described once, here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.model_description import TEXT, ModelDescription

from .config import decoder_shape, language_model_config
from .family import MODEL_TYPES, family_for


def describe_hf(cfg: dict[str, Any], name: str, where: str | Path = "config.json") -> ModelDescription:
    """A decoder's config (LLaMA / Qwen2 / Mistral / SmolLM keys) or a VLM's (its `text_config` and tower)."""
    shape = decoder_shape(language_model_config(cfg), where, name)
    model_type = str(cfg.get("model_type") or "llama")
    built = cfg.get("edgekit_vlm") or {}
    family = family_for(model_type) if model_type in MODEL_TYPES else None
    try:
        vision = family.vision_description(cfg, built) if family else None
    except (KeyError, TypeError, ValueError) as err:
        why = f"{type(err).__name__}: {err}"
        raise ConfigError(f"vision_config: cannot read the tower's shape ({why})", where) from None
    return ModelDescription.of(
        shape,
        vision=vision,
        family=family.name if family else model_type,
        positions=family.positions if family else TEXT,
    )
