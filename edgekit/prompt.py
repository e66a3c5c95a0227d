"""The decoder's input, assembled in one place: `<bos> + template(modality, prompt) + <sep>`, and where the image
span goes in it (a text model served as plain completion has no `<sep>`, and `<bos>` only where its tokenizer
adds one: `bos_token_id` / `sep_token_id` null).

The reporter, calibration and the x1 engine all feed the decoder the prompt the model was trained on; the
template and the special ids come from the bundle's `generation_config.json`, never from constants here. Where
the span goes is the template's to say: an imported VLM's template keeps its image token (`image_token`, e.g.
llava's `<image>`) where its chat template puts it, and the span goes there, as the model's processor puts it; a
template without one (radreport-tiny's) has the span in front of `<bos>`, as it was trained.

How many decoder positions the span takes is one fact too (`image_tokens`): the reporter's context budget and a
target's shape limits both read it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from edgekit import names
from edgekit.errors import ConfigError

DEFAULT_TEMPLATE = "{modality}: {prompt}"
DEFAULT_PROMPT = "Not given."
IMAGE_TOKEN = "image_token"  # generation_config key: the image token's text, standing in prompt_template


@dataclass(frozen=True)
class PromptLayout:
    """The text tokens of one prompt and the index among them before which the image span goes (0: in front of
    `<bos>`). The image token itself is not in `ids`: the vision graph's span stands for it."""

    ids: list[int]
    image_slot: int = 0


def prompt_text(generation_config: Mapping, modality: str, prompt: str) -> str:
    """The template filled in; an empty prompt becomes the config's `default_prompt` (what training used)."""
    g = generation_config
    return g.get("prompt_template", DEFAULT_TEMPLATE).format(
        modality=modality, prompt=prompt.strip() or g.get("default_prompt", DEFAULT_PROMPT)
    )


def prompt_layout(tokenizer, generation_config: Mapping, modality: str, prompt: str) -> PromptLayout:
    """Token ids of the decoder's text input (no special tokens from the tokenizer, ours around it) and the image
    slot. The filled-in template is tokenized whole, image token included, as a processor tokenizes it (its text
    around the image token splits there either way), then the template's own image token is taken out: the first
    one when it stands before the user's text, the last when after, so a user who types it does not move it."""
    g = generation_config
    ids = tokenizer.encode(prompt_text(g, modality, prompt), add_special_tokens=False).ids
    bos, sep = g.get("bos_token_id"), g.get("sep_token_id")  # null: none (a text model served as plain completion)
    head, tail = ([] if bos is None else [bos]), ([] if sep is None else [sep])
    marker = g.get(IMAGE_TOKEN)
    if marker is None:
        return PromptLayout([*head, *ids, *tail], 0)
    marker_id = tokenizer.token_to_id(marker)
    found = [i for i, t in enumerate(ids) if t == marker_id] if marker_id is not None else []
    if not found:
        raise ConfigError(f"generation_config: the template's image token {marker!r} does not tokenize to one token")
    template = g.get("prompt_template", DEFAULT_TEMPLATE)
    user = template.find("{prompt}")
    at = found[0] if user < 0 or template.index(marker) < user else found[-1]
    return PromptLayout([*head, *ids[:at], *ids[at + 1 :], *tail], at + len(head))


def prompt_ids(tokenizer, generation_config: Mapping, modality: str, prompt: str) -> list[int]:
    """Token ids of the decoder's text input: no special tokens from the tokenizer, ours around it."""
    return prompt_layout(tokenizer, generation_config, modality, prompt).ids


def image_tokens(model_config: Mapping) -> int:
    """Decoder positions one image takes: the config's `image_tokens` (an imported VLM's whole span, wrapper
    tokens included), else edgekit's own VLM config's count, else 0 (a decoder without images)."""
    if names.IMAGE_TOKENS in model_config:
        return int(model_config[names.IMAGE_TOKENS])
    if "image_size" in model_config:
        from edgekit.export.model_config import ModelConfig

        return ModelConfig.from_dict(dict(model_config)).num_image_tokens
    return 0


def context_positions(model_config: Mapping) -> int | None:
    """The decoder's whole context (image, prompt and report together); None when the config does not say."""
    positions = model_config.get("max_positions", model_config.get("max_position_embeddings"))
    return int(positions) if positions else None
