"""Hugging Face `config.json` -> edgekit's graph specs, refusing what the graph builders do not implement.

Why refuse instead of guess: an unsupported option (a rope scaling we do not compute, an o_proj bias) would give
a graph that runs but answers differently from the checkpoint — the silent accuracy loss this tool exists to
prevent. Each refusal is one line naming config.json and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.decoder_shape import DecoderShape
from edgekit.errors import ConfigError
from edgekit.export.specs import DecoderSpec

DECODER_TYPES = ("llama", "mistral", "qwen2")
VISION_TYPES = ("vit", "siglip_vision_model", "siglip")
VLM_TYPES = ("llava", "idefics3", "smolvlm", "llava_next", "qwen2_vl", "qwen2_5_vl")
SUPPORTED_MODEL_TYPES = DECODER_TYPES + VISION_TYPES + VLM_TYPES
# families asked for that edgekit does not build, with why (the refusal says it, then lists what it imports)
NOT_BUILT: dict[str, str] = {}
ROPE_TYPES = ("default", "linear", "llama3")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    return read_config_file(Path(model_dir) / "config.json")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """One `config.json` file as a dict, refused in one line when it is missing, unreadable or not a JSON object:
    the single reader of Hugging Face configs (the X1 cost model reads its shapes through it too)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path.name} not found", path)
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"not valid JSON ({exc.__class__.__name__})", path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.__class__.__name__})", path) from None
    if not isinstance(cfg, dict):
        raise ConfigError("not a JSON object", path)
    return cfg


DECODER_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def decoder_shape_fields(cfg: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """A LLaMA-style config's shape fields as written (callers validate their types), with transformers' defaults
    for `num_key_value_heads` (the heads) and `head_dim` (hidden // heads); a missing one is refused by name.
    For readers that need the shape only (the X1 cost model), not a graph spec (`decoder_spec`)."""
    for key in DECODER_SHAPE_KEYS:
        if cfg.get(key) is None:
            raise ConfigError(f"{key} is missing", where)
    heads = cfg["num_attention_heads"]
    return {
        **{key: cfg[key] for key in DECODER_SHAPE_KEYS},
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def decoder_shape(cfg: dict[str, Any], where: str | Path, name: str = "") -> DecoderShape:
    """A LLaMA-style config's decoder as a `DecoderShape`: `decoder_shape_fields` (the one reader), each size a
    number taken as the whole number it is, refused in one line naming config.json otherwise. What the graph specs
    hold (`edgekit.export.specs.DecoderSpec`) and the cost models' description is made of (`describe_hf`)."""
    fields = decoder_shape_fields(cfg, where)
    sizes = {key: _get(fields, key, Path(where)) for key in (*DECODER_SHAPE_KEYS, "num_key_value_heads", "head_dim")}
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    for key, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{key}: expected a positive number, got {value!r}", where)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}", where)
    return DecoderShape(
        name,
        hidden=sizes["hidden_size"],
        layers=sizes["num_hidden_layers"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=sizes["head_dim"],
        intermediate=sizes["intermediate_size"],
        vocab=sizes["vocab_size"],
        tied_embeddings=fields["tie_word_embeddings"],
    )


def language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config's language model: a VLM's `text_config`, with the top level's `tie_word_embeddings` where Hugging
    Face's VLM configs keep it; a decoder's (or edgekit's own) config as it is. For shape readers (the targets'
    cost models), which take a bundle's config.json whatever model it holds."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or not text:
        return cfg
    return {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def is_hf_model_dir(model_dir: str | Path) -> bool:
    """A Hugging Face directory says what it is in config.json's `model_type` (edgekit's own configs do not)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(cfg, dict) and "model_type" in cfg


def model_kind(cfg: dict[str, Any], model_dir: str | Path) -> str:
    """'decoder', 'vision' or 'vlm'; anything else is refused in one line listing what is supported."""
    mt = cfg.get("model_type")
    if mt in DECODER_TYPES:
        return "decoder"
    if mt in VISION_TYPES:
        return "vision"
    if mt in VLM_TYPES:
        return "vlm"
    why = f" ({NOT_BUILT[mt]})" if mt in NOT_BUILT else ""
    raise ConfigError(
        f"model_type {mt!r} is not supported{why}; edgekit imports {', '.join(SUPPORTED_MODEL_TYPES)}",
        Path(model_dir) / "config.json",
    )


def _get(cfg: dict, key: str, where: Path, kind=int):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{key} is missing", where)
    try:
        return kind(cfg[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {cfg[key]!r}", where) from None


def rope_parameters(cfg: dict) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters` (theta inside); 4.x wrote `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(params: dict[str, Any], head_dim: int, where: Path) -> tuple[float, ...] | None:
    """The rotary inverse frequencies when they differ from plain `theta^(-2i/d)` (None when they do not),
    following transformers' `ROPE_INIT_FUNCTIONS` for the types that only rescale frequencies."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"rope_parameters.rope_type {rope_type!r} is not supported (edgekit computes {', '.join(ROPE_TYPES)})",
            where,
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor other than 1.0 is not supported", where)
    theta = float(params["rope_theta"])
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    if rope_type == "default":
        return None
    factor = float(params.get("factor", 1.0))
    if rope_type == "linear":
        return tuple(float(x) for x in inv / factor)
    # llama3: long wavelengths slowed by `factor`, short kept, a smooth blend between
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    out = np.where(medium, smoothed, out)
    return tuple(float(x) for x in out)


def check_full_window(cfg: dict[str, Any], where: Path, section: str = "") -> None:
    """Mistral is LLaMA's math; a sliding window shorter than the context would attend differently, so it is
    refused (`section`: where the keys sit, e.g. "text_config.")."""
    window, ctx = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if window is not None and (ctx is None or window < ctx):
        raise ConfigError(
            f"{section}sliding_window {window} is shorter than max_position_embeddings {ctx}; edgekit's decoder "
            "attends over the whole cache",
            where,
        )


def decoder_spec(cfg: dict[str, Any], model_dir: str | Path, names: Collection[str]) -> DecoderSpec:
    """LLaMA / Mistral / Qwen2 config -> DecoderSpec over its `decoder_shape` (the one reader of the sizes).
    `names` (the checkpoint's tensors) decide tied vs untied lm_head."""
    where = Path(model_dir) / "config.json"
    mt = cfg.get("model_type")
    shape = decoder_shape(cfg, where, Path(model_dir).name)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (edgekit's decoder is SwiGLU with silu)", where)
    if mt == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConfigError("attention_bias/mlp_bias = true is not supported for llama (o_proj/MLP biases)", where)
    if mt == "mistral":
        check_full_window(cfg, where)
    if mt == "qwen2" and cfg.get("use_sliding_window"):
        raise ConfigError("use_sliding_window = true is not supported (edgekit attends over the full cache)", where)
    params = rope_parameters(cfg)
    inv_freq = rope_inv_freq(params, shape.head_dim, where)
    lm_head = "model.embed_tokens" if shape.tied_embeddings or "lm_head.weight" not in names else "lm_head"
    return DecoderSpec(
        shape,
        rms_eps=_get(cfg, "rms_norm_eps", where, float),
        rope_theta=float(params["rope_theta"]),
        qkv_bias=mt == "qwen2",
        lm_head=lm_head,
        rope_inv_freq=inv_freq,
    )


def language_model_spec(
    text: dict[str, Any],
    model_dir: str | Path,
    names_: Collection[str],
    lm_prefixes: tuple[tuple[str, str], ...],
    *,
    module: str | None = None,
    tied: bool = False,
) -> tuple[DecoderSpec, str]:
    """A VLM's language model: (its DecoderSpec named under `module`, or under the checkpoint's own prefix when
    None; the checkpoint's prefix). `lm_prefixes` lists (prefix, lm_head) layouts to look for; the head is the
    embedding when `tied` or when the checkpoint has no head of its own."""
    where = Path(model_dir) / "config.json"
    found = next(((p, h) for p, h in lm_prefixes if f"{p}embed_tokens.weight" in names_), None)
    if found is None:
        raise ConfigError(
            "no language model weights found (looked for embed_tokens.weight under "
            f"{', '.join(p for p, _ in lm_prefixes)})",
            where,
        )
    prefix, head = found
    named = module if module is not None else prefix
    spec = decoder_spec(text, model_dir, names_)
    spec = dataclasses.replace(
        spec,
        shape=dataclasses.replace(spec.shape, tied_embeddings=True) if tied else spec.shape,
        layer_prefix=f"{named}layers",
        embed_tokens=f"{named}embed_tokens",
        final_norm=f"{named}norm",
        lm_head=f"{named}embed_tokens" if tied or f"{head}.weight" not in names_ else head,
    )
    return spec, prefix
