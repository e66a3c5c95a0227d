"""The decoder's text input, assembled in one place: `<bos> + template(modality, prompt) + <sep>`.

The reporter, calibration and the x1 engine all feed the decoder the prompt the model was trained on; the
template and the special ids come from the bundle's `generation_config.json`, never from constants here.
"""

from __future__ import annotations

from collections.abc import Mapping

DEFAULT_TEMPLATE = "{modality}: {prompt}"
DEFAULT_PROMPT = "Not given."


def prompt_text(generation_config: Mapping, modality: str, prompt: str) -> str:
    """The template filled in; an empty prompt becomes the config's `default_prompt` (what training used)."""
    g = generation_config
    return g.get("prompt_template", DEFAULT_TEMPLATE).format(
        modality=modality, prompt=prompt.strip() or g.get("default_prompt", DEFAULT_PROMPT)
    )


def prompt_ids(tokenizer, generation_config: Mapping, modality: str, prompt: str) -> list[int]:
    """Token ids of the decoder's text input: no special tokens from the tokenizer, ours around it."""
    ids = tokenizer.encode(prompt_text(generation_config, modality, prompt), add_special_tokens=False).ids
    return [generation_config["bos_token_id"], *ids, generation_config["sep_token_id"]]
