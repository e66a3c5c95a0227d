"""What a bundle of an imported decoder-only model (LLaMA, Qwen2, Mistral: a text report model, which reads
structured findings or prior reports) carries beside its two graphs: the model's own `tokenizer.json`, an edgekit
`generation_config.json` holding its prompt layout, and its `config.json`. No vision graph and no image
preprocessing: the bundle says it is a text model by having none (`edgekit.bundle.manifest.required_roles`).

Two layouts, decided here once so the runtime needs neither Jinja nor transformers:
- a chat model (its chat template wraps the user's turn: LLaMA-2-chat's `[INST]`, ChatML): the template rendered
  for one user turn and cut into `<bos> + template(prompt) + <sep>` as a VLM's is (`serving.cut_turn`), tokenized
  as transformers' `apply_chat_template` tokenizes it, without the tokenizer's own special tokens (the template
  writes them), so the served prompt is the one `generate()` sees after `apply_chat_template`;
- plain completion (no chat template, or one that writes the user's text alone): the prompt as the tokenizer
  encodes it, its own `<bos>` included, which is how `edgekit finetune` trains a prompt + completion pair.
A chat template that cannot be rendered here (no jinja2) is refused rather than guessed at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.export.specs import DecoderSpec

from .serving import (
    SENTINEL,
    chat_template,
    cut_turn,
    generation_ends,
    read_tokenizer,
    rendered_turn,
    write_model_files,
)

PLAIN_SAMPLES = ("Findings.", "a b c")  # prompts the plain layout is checked on


def text_generation_config(model_dir: Path, tokenizer) -> dict[str, Any]:
    """edgekit's generation config for a decoder: its chat template's user turn cut into `bos + template + sep`,
    or plain completion where the template writes the user's text alone or there is none."""
    text = None
    if chat_template(model_dir) is not None:
        text = rendered_turn(model_dir, image=False)
        if text is None:
            raise ConfigError("rendering the chat template needs jinja2 (pip install jinja2)", model_dir)
        if text.count(SENTINEL) != 1:
            raise ConfigError("the chat template does not write the user's text once for one user turn", model_dir)
    if text is None or text.strip() == SENTINEL:
        return plain_generation_config(model_dir, tokenizer)
    return cut_turn(text, None, model_dir, tokenizer, add_special_tokens=False)


def plain_generation_config(model_dir: Path, tokenizer) -> dict[str, Any]:
    """The prompt as `tokenizer.encode(prompt)` gives it: `<bos>` where the tokenizer puts one in front, no `<sep>`;
    a tokenizer that adds anything else (an end token after the prompt) cannot be served so and is refused."""
    bos = None
    for sample in PLAIN_SAMPLES:
        whole = tokenizer.encode(sample, add_special_tokens=True).ids
        bare = tokenizer.encode(sample, add_special_tokens=False).ids
        if whole != bare and whole[1:] != bare:
            raise ConfigError(
                "the tokenizer adds special tokens other than one in front of the prompt; edgekit serves a decoder "
                "without a chat template as <bos> + prompt",
                model_dir / "tokenizer.json",
            )
        bos = whole[0] if whole != bare else None
    return {
        "prompt_template": "{prompt}",
        "prompt_format": "the prompt as the tokenizer encodes it (its own <bos>, if any); the model's chat template "
        "is absent or writes the user's text alone, so it is served as plain completion",
        "bos_token_id": bos,
        "sep_token_id": None,
        **generation_ends(model_dir, tokenizer),
    }


def text_model_config(spec: DecoderSpec, cfg: dict[str, Any]) -> dict[str, Any]:
    """The model's config.json, plus `max_positions` (its whole context, which the reporter's context budget and the
    targets' shape limits read: `edgekit.prompt`) and what edgekit built from it."""
    out = dict(cfg)
    if cfg.get("max_position_embeddings"):
        out["max_positions"] = int(cfg["max_position_embeddings"])
    out["edgekit_text"] = text_model_summary(spec, cfg)
    return out


def text_model_summary(spec: DecoderSpec, cfg: dict[str, Any]) -> dict[str, Any]:
    """What was imported, for the bundle's config.json and the build's provenance step."""
    return {
        "kind": "decoder",
        "model_type": cfg.get("model_type"),
        "decoder_layers": spec.layers,
        "hidden": spec.hidden,
        "heads": spec.heads,
        "kv_heads": spec.kv_heads,
        "vocab_size": spec.vocab_size,
        "tied_lm_head": spec.lm_head == spec.embed_tokens,
    }


def write_text_serving_files(spec: DecoderSpec, model_dir: Path, cfg: dict[str, Any], out: Path) -> dict[str, Path]:
    """A text bundle's model files by role (tokenizer, generation_config, model_config), written into `out`."""
    tokenizer = read_tokenizer(model_dir)
    files = {
        "generation_config": text_generation_config(model_dir, tokenizer),
        "model_config": text_model_config(spec, cfg),
    }
    return write_model_files(model_dir, files, out)
