"""What a bundle of an imported decoder-only model (LLaMA, Qwen2, Mistral: a text report model, which reads
structured findings or prior reports) carries beside its two graphs: the model's own `tokenizer.json`, an edgekit
`generation_config.json` holding its chat template, and its `config.json`. No vision graph and no image
preprocessing: the bundle says it is a text model by having none (`edgekit.bundle.manifest.required_roles`).

The chat template is rendered once, here, for one user turn and cut into `<bos> + template(prompt) + <sep>` as a
VLM's is (`serving.cut_turn`), so the runtime needs neither Jinja nor transformers. The turn is tokenized as
transformers' `apply_chat_template` tokenizes it: without the tokenizer's own special tokens, which the template
writes (`{{ bos_token }}`), so the served prompt is the one `generate()` sees after `apply_chat_template`. Unlike a
VLM, a decoder has no family layout to fall back on (base and chat checkpoints of one family differ): a directory
without a chat template, or a machine without jinja2, is refused rather than served a guessed prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.export.specs import DecoderSpec

from .serving import SENTINEL, chat_template, cut_turn, read_tokenizer, rendered_turn, write_model_files


def text_generation_config(model_dir: Path, tokenizer) -> dict[str, Any]:
    """edgekit's generation config for a decoder: `bos + template + sep` cut from its chat template's user turn."""
    if chat_template(model_dir) is None:
        raise ConfigError(
            "no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); edgekit serves a "
            "decoder's prompts through it",
            model_dir,
        )
    text = rendered_turn(model_dir, image=False)
    if text is None:
        raise ConfigError("rendering the chat template needs jinja2 (pip install jinja2)", model_dir)
    if text.count(SENTINEL) != 1:
        raise ConfigError("the chat template does not write the user's text once for one user turn", model_dir)
    return cut_turn(text, None, model_dir, tokenizer, add_special_tokens=False)


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
