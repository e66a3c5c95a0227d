"""Convert a local Hugging Face directory (config.json + safetensors) into edgekit's ONNX graphs.

Decoders (LLaMA, Qwen2) give `embed_tokens.onnx` + `decoder_model_merged.onnx` with a KV cache, in the same
signature as radreport-tiny's graphs, so generation, passes and bundles take them unchanged. Vision models
(ViT, SigLIP) give `vision_encoder.onnx` (pixel_values -> last_hidden_state).

Memory stays bounded by the largest tensor: graphs are built against shape-only stand-ins, each initializer
is then pointed at its checkpoint tensor lazily, and the writer reads, writes and drops one tensor at a time
(weights above `external_data_threshold_bytes` go to `<graph>.onnx.data`). Output is assembled in a hidden
sibling folder and moved into place only when every graph was written (and checked), so a failure never
leaves a folder that looks converted.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import ChainMap
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.export.decoder import build_decoder
from edgekit.export.default import DECODER, EMBED_TOKENS, VISION_ENCODER
from edgekit.export.embed import build_embed_tokens
from edgekit.export.save import save_model, validate
from edgekit.export.specs import DecoderSpec
from edgekit.export.weights import decoder_layer_shapes
from edgekit.positions import MROPE, POSITIONS_KEY

from .checkpoint import CheckpointError, SafetensorsCheckpoint, ShapeOnlyWeights, attach_lazy_weights
from .config import decoder_spec, model_kind, read_config_file, read_hf_config
from .qwen2_vl_processor import image_size_refused
from .spec_base import VlmSpecBase
from .vision_tower import VisionTowerSpec, build_vision_tower, vision_tower_spec
from .vlm import build_vlm_vision, expected_vlm_shapes, span_rows, vlm_spec

# files copied next to the graphs (config.json is renamed: edgekit's own config.json means a ModelConfig)
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "processor_config.json",
)
HF_CONFIG = "hf_config.json"
PREPROCESSOR = "preprocessor_config.json"
# A graph written inline is serialised whole in memory (every weight at once, then the protobuf copy): above this,
# weights go to `<graph>.onnx.data` and are written one tensor at a time, so converting a 2B-class model needs
# little more than its largest tensor (a 1.2 GB vision tower inline peaked at 3.5 GB of RSS).
HF_EXTERNAL_DATA_THRESHOLD_BYTES = 256 * 1024 * 1024


@dataclass
class HfConversion:
    kind: str  # "decoder" | "vision" | "vlm"
    model_type: str
    out: Path
    graphs: list[Path] = field(default_factory=list)
    spec: DecoderSpec | VisionTowerSpec | VlmSpecBase | None = None


def expected_decoder_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    h = spec.hidden
    shapes = {
        f"{spec.embed_tokens}.weight": (spec.vocab_size, h),
        f"{spec.final_norm}.weight": (h,),
        f"{spec.lm_head}.weight": (spec.vocab_size, h),
    }
    for i in range(spec.layers):
        shapes.update(
            decoder_layer_shapes(
                f"{spec.layer_prefix}.{i}",
                h,
                spec.heads,
                spec.kv_heads,
                spec.head_dim,
                spec.intermediate,
                spec.qkv_bias,
            )
        )
    return shapes


def check_shapes(expected: dict[str, tuple[int, ...]], ckpt: SafetensorsCheckpoint) -> None:
    """Every tensor the graph needs, present and of the shape config.json implies, before anything is built."""
    problems = []
    for name, shape in expected.items():
        if name not in ckpt.entries:
            problems.append(f"{name} is missing")
        elif ckpt.shape(name) != shape:
            problems.append(f"{name} has shape {ckpt.shape(name)}, config.json implies {shape}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError("checkpoint does not match config.json: " + "; ".join(problems[:3]) + more, ckpt.dir)


def _write(model: ir.Model, ckpt: SafetensorsCheckpoint, path: Path, threshold: int, aliases=None) -> Path:
    attach_lazy_weights(model, ckpt, aliases)
    return save_model(model, path, external_data_threshold_bytes=threshold)


def _write_decoder(stand_ins, spec: DecoderSpec, ckpt, tmp: Path, threshold: int, aliases=None) -> list[Path]:
    return [
        _write(build_embed_tokens(stand_ins, spec), ckpt, tmp / EMBED_TOKENS, threshold, aliases),
        _write(build_decoder(stand_ins, spec), ckpt, tmp / DECODER, threshold, aliases),
    ]


def convert_hf(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    external_data_threshold_bytes: int = HF_EXTERNAL_DATA_THRESHOLD_BYTES,
    check: bool = True,
    image_size: int | None = None,
) -> HfConversion:
    """Convert the Hugging Face model in `model_dir` into graphs in `out_dir` (created or updated).

    `image_size` pins Qwen2-VL's / Qwen2.5-VL's dynamic resolution to that square side: the graphs, the M-RoPE
    grid and the `preprocessor_config.json` written beside them (`min_pixels = max_pixels = image_size**2`) all
    use it; `model_dir` is only read. Any other family refuses it."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not model_dir.is_dir():
        raise ConfigError("model directory not found", model_dir)
    cfg = read_hf_config(model_dir)
    kind = model_kind(cfg, model_dir)
    if image_size is not None and kind != "vlm":  # before anything is written
        raise image_size_refused(str(cfg["model_type"]), model_dir / "config.json", kind)
    ckpt = SafetensorsCheckpoint(model_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    result = HfConversion(kind=kind, model_type=str(cfg["model_type"]), out=out_dir)
    try:
        written: list[Path] = []
        vlm: VlmSpecBase | None = None
        if kind == "vlm":
            result.spec = vlm = vlm_spec(cfg, model_dir, ckpt.entries, image_size=image_size)
            expected = {**expected_vlm_shapes(vlm, cfg), **expected_decoder_shapes(vlm.decoder)}
            check_shapes({vlm.to_checkpoint(k): v for k, v in expected.items()}, ckpt)
            aliases = vlm.aliases(ckpt.entries)
            stand_ins = ShapeOnlyWeights(ckpt, aliases)
            # the span's few rows are real. typeshed's ChainMap takes MutableMappings only; a read-only one is
            # fine for reading, which is all the graph builder does
            vision_weights = ChainMap(span_rows(vlm, ckpt), stand_ins)  # type: ignore[arg-type]
            vision = build_vlm_vision(vision_weights, vlm)
            written.append(_write(vision, ckpt, tmp / VISION_ENCODER, external_data_threshold_bytes, aliases))
            written += _write_decoder(stand_ins, vlm.decoder, ckpt, tmp, external_data_threshold_bytes, aliases)
        elif kind == "decoder":
            result.spec = decoder = decoder_spec(cfg, model_dir, ckpt.entries)
            check_shapes(expected_decoder_shapes(decoder), ckpt)
            written += _write_decoder(ShapeOnlyWeights(ckpt), decoder, ckpt, tmp, external_data_threshold_bytes)
        else:
            result.spec = tower = vision_tower_spec(cfg, model_dir, ckpt.entries)
            written.append(
                _write(
                    build_vision_tower(ShapeOnlyWeights(ckpt), tower),
                    ckpt,
                    tmp / VISION_ENCODER,
                    external_data_threshold_bytes,
                )
            )
        if check:
            for p in written:
                validate(p)
        for name in SIDE_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        shutil.copy2(model_dir / "config.json", tmp / HF_CONFIG)
        if vlm is not None and vlm.pinned:  # the processor pinned to the graphs' side, not the directory's range
            pre = read_config_file(model_dir / PREPROCESSOR) if (model_dir / PREPROCESSOR).is_file() else None
            (tmp / PREPROCESSOR).write_text(json.dumps(vlm.processor_config(pre), indent=2) + "\n")
        if vlm is not None and vlm.positions.kind == MROPE:  # the decoder's position_ids, for whoever feeds it
            (tmp / HF_CONFIG).write_text(json.dumps({**cfg, POSITIONS_KEY: vlm.positions.to_dict()}, indent=2) + "\n")
        out_dir.mkdir(parents=True, exist_ok=True)
        for item in sorted(tmp.iterdir()):
            if item.suffix == ".onnx":  # a stale weights file from an earlier, larger export must not linger
                (out_dir / (item.name + ".data")).unlink(missing_ok=True)
            os.replace(item, out_dir / item.name)
        result.graphs = [out_dir / p.name for p in written]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
