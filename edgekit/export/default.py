"""Export radreport-tiny (or any weights matching a ModelConfig) to the three ONNX graphs the runtimes load."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.model_config import ModelConfig

from .decoder import build_decoder
from .embed import build_embed_tokens
from .save import EXTERNAL_DATA_THRESHOLD_BYTES, save_model, validate
from .specs import DecoderSpec, VisionSpec
from .vision import build_vision_encoder
from .weights import check_weights, load_weights

VISION_ENCODER, EMBED_TOKENS, DECODER = names.VISION_ENCODER, names.EMBED_TOKENS, names.DECODER


@dataclass(frozen=True)
class ExportedGraphs:
    vision_encoder: Path
    embed_tokens: Path
    decoder: Path


def export_model(
    weights: Mapping[str, np.ndarray],
    config: ModelConfig,
    out_dir: str | Path,
    *,
    external_data_threshold_bytes: int = EXTERNAL_DATA_THRESHOLD_BYTES,
    check: bool = True,
) -> ExportedGraphs:
    """Build, write and (by default) fully check all three graphs. Weights are checked against the config first."""
    check_weights(dict(weights), config)
    out_dir = Path(out_dir)
    dec, vis = DecoderSpec.from_model_config(config), VisionSpec.from_model_config(config)
    kw = {"external_data_threshold_bytes": external_data_threshold_bytes}
    paths = ExportedGraphs(
        vision_encoder=save_model(build_vision_encoder(weights, vis), out_dir / VISION_ENCODER, **kw),
        embed_tokens=save_model(build_embed_tokens(weights, dec), out_dir / EMBED_TOKENS, **kw),
        decoder=save_model(build_decoder(weights, dec), out_dir / DECODER, **kw),
    )
    if check:
        for p in (paths.vision_encoder, paths.embed_tokens, paths.decoder):
            validate(p)
    return paths


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("model config not found", path)
    try:
        return ModelConfig.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not a valid model config ({exc.__class__.__name__})", path) from exc


def export_default(weights_dir: str | Path, out_dir: str | Path, **kwargs) -> ExportedGraphs:
    """`model.safetensors` + `config.json` in `weights_dir` -> the three graphs in `out_dir`."""
    weights_dir = Path(weights_dir)
    config = load_model_config(weights_dir / "config.json")
    weights = load_weights(weights_dir / "model.safetensors")
    check_weights(weights, config, weights_dir / "model.safetensors")
    return export_model(weights, config, out_dir, **kwargs)
