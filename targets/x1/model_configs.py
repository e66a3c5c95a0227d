"""Decoder shapes the X1 cost model reads: everything it needs to count bytes and MACs, and nothing else.

The analytic mode budgets a model before any weights exist, so a shape is just numbers (`edgekit.decoder_shape`,
shared with the Orin estimate): the calibration target (Qwen2-7B), the default model (radreport-tiny, from its
`ModelConfig`) and a small public LLM (SmolLM2-135M). A Hugging Face `config.json` (LLaMA/Qwen2 keys, read by
`edgekit.hf.config`) or edgekit's own `config.json` is read too.
"""

from __future__ import annotations

from pathlib import Path

from edgekit.decoder_shape import DecoderShape
from edgekit.errors import ConfigError

QWEN2_7B = DecoderShape(
    name="qwen2-7b",
    hidden=3584,
    layers=28,
    heads=28,
    kv_heads=4,
    head_dim=128,
    intermediate=18944,
    vocab=152064,
    tied_embeddings=False,
)
SMOLLM2_135M = DecoderShape(
    name="smollm2-135m",
    hidden=576,
    layers=30,
    heads=9,
    kv_heads=3,
    head_dim=64,
    intermediate=1536,
    vocab=49152,
    tied_embeddings=True,
)


def radreport_tiny(config=None) -> DecoderShape:
    """The default model's decoder; `config` is a `ModelConfig` (the default one when omitted)."""
    from edgekit.export.model_config import ModelConfig

    c = config or ModelConfig()
    return DecoderShape(
        name="radreport-tiny",
        hidden=c.hidden,
        layers=c.layers,
        heads=c.heads,
        kv_heads=c.kv_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate,
        vocab=c.vocab_size,
        tied_embeddings=False,
    )


KNOWN = {"qwen2-7b": lambda: QWEN2_7B, "smollm2-135m": lambda: SMOLLM2_135M, "radreport-tiny": radreport_tiny}


def _from_json(path: Path) -> DecoderShape:
    """A Hugging Face config (read by `edgekit.hf.config`, the one config.json reader) or edgekit's own."""
    from edgekit.hf.config import (  # importing edgekit.hf takes a second
        decoder_shape_fields,
        language_model_config,
        read_config_file,
    )

    d = language_model_config(read_config_file(path))  # an imported VLM: its language model
    if "hidden_size" in d:  # Hugging Face LLaMA / Qwen2 / SmolLM keys
        f = decoder_shape_fields(d, path)
        return DecoderShape(
            name=path.parent.name or path.stem,
            hidden=f["hidden_size"],
            layers=f["num_hidden_layers"],
            heads=f["num_attention_heads"],
            kv_heads=f["num_key_value_heads"],
            head_dim=f["head_dim"],
            intermediate=f["intermediate_size"],
            vocab=f["vocab_size"],
            tied_embeddings=f["tie_word_embeddings"],
        )
    from edgekit.export.model_config import ModelConfig

    try:
        return radreport_tiny(ModelConfig.from_dict(d))
    except TypeError as err:
        raise ConfigError(f"not a model config: {err}", path) from err


def resolve(model: str) -> DecoderShape:
    """A known name (`qwen2-7b`, `radreport-tiny`, `smollm2-135m`) or a path to a `config.json`."""
    if model in KNOWN:
        return KNOWN[model]()
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _from_json(path)
    raise ConfigError(f"unknown model '{model}' (known: {', '.join(KNOWN)}; or a path to a config.json)")
