"""A model described from what a user names: a preset, a `config.json` or its directory, or a bundle's config.

Why apart from `model_description`: describing a Hugging Face config goes through its family (`edgekit.hf`),
which itself builds `ModelDescription`s; this module sits above both, so neither imports the other's side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.model_description import PRESETS as NAMED_DECODERS
from edgekit.model_description import ModelDescription, from_model_config


def _radreport_tiny() -> ModelDescription:
    """The embedded model as it ships (its weights' config.json, found through the model-family registry)."""
    from edgekit.export.model_config import ModelConfig
    from edgekit.plugins import get_model_family

    return from_model_config(ModelConfig.load(get_model_family().weights_dir() / "config.json"))


# Every model known by name: the core's named decoders and the embedded radreport-tiny
PRESETS = {**NAMED_DECODERS, "radreport-tiny": _radreport_tiny}


def describe_config(cfg: dict[str, Any], name: str, where: str | Path = "config.json") -> ModelDescription:
    """A `config.json` as a bundle or a model directory holds it: a Hugging Face one (it names its `model_type`),
    described by its family, or edgekit's own."""
    if "model_type" in cfg or "hidden_size" in cfg:
        from edgekit.hf.describe import describe_hf  # importing edgekit.hf takes a second

        return describe_hf(cfg, name, where)
    from edgekit.export.model_config import ModelConfig

    try:
        return from_model_config(ModelConfig.from_dict(cfg), name)
    except TypeError as err:
        raise ConfigError(f"not a model config: {err}", where) from err


def read_config(path: str | Path, name: str | None = None) -> ModelDescription:
    """A `config.json` file (Hugging Face or edgekit's own), read by the one config reader."""
    from edgekit.hf.config import read_config_file

    path = Path(path)
    return describe_config(read_config_file(path), name or path.parent.name or path.stem, path)


def describe(model: str | Path, presets: dict | None = None) -> ModelDescription:
    """A preset name (`qwen2-7b`, `radreport-tiny`, ...) or a path to a `config.json` or its directory."""
    known = PRESETS if presets is None else presets
    if isinstance(model, str) and model in known:
        return known[model]()
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return read_config(path)
    raise ConfigError(f"unknown model '{model}' (known: {', '.join(known)}; or a path to a config.json)")
