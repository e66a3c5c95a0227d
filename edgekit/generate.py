"""Generation's shared vocabulary (options, sampling, timings, the one-sequence backend protocol) and its two
entry points, which go through the engine (`edgekit.engine`: the one decoding loop).

The loop is the same everywhere, so targets differ only in the math of their three calls: image features are put
among the prompt's embeddings at the prompt's image slot (`edgekit.prompt.PromptLayout`: in front for
radreport-tiny, where the chat template's image token stands for an imported VLM), one prefill call fills the KV
cache, then one decode call per new token.
Greedy at temperature 0; otherwise temperature + top-p (nucleus) sampling from a seeded numpy Generator, so a
seed reproduces a report on every target.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgekit.engine import Engine, Request
from edgekit.engine.sequence import (  # noqa: F401 - the vocabulary callers import from here
    DEFAULT_MAX_NEW_TOKENS,
    KV,
    MAX_NEW_TOKENS,
    MAX_TEMPERATURE,
    Backend,
    GenerationOptions,
    GenerationResult,
    OnToken,
    Timings,
    next_tokens,
    place_image,
    request_options,
    take_cost,
)
from edgekit.errors import EdgekitError
from edgekit.positions import PositionScheme


def _as_batch(prompt_ids, pixel_values) -> tuple[np.ndarray, np.ndarray | None]:
    ids = np.asarray(prompt_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise EdgekitError(f"prompt_ids must be (batch, seq) with seq >= 1, got shape {ids.shape}")
    if pixel_values is None:  # text only
        return ids, None
    pv = np.asarray(pixel_values, dtype=np.float32)
    if pv.ndim != 5 or pv.shape[0] != ids.shape[0]:
        raise EdgekitError(
            f"pixel_values must be (batch, frames, 1, H, W) matching the prompt batch "
            f"{ids.shape[0]}, got shape {pv.shape}"
        )
    return ids, pv


def generate_batch(
    backend: Backend,
    pixel_values,
    prompt_ids,
    options: GenerationOptions,
    prompt_attention_mask: np.ndarray | None = None,
    on_token: OnToken | None = None,
    image_slot: int | Sequence[int] = 0,
    positions: PositionScheme | None = None,
) -> list[GenerationResult]:
    """Generate for a batch (`pixel_values` None: text only) through the engine (`edgekit.engine`): each row is
    one request, decoded together with the others. Prompts of different lengths may come left-padded, with
    `prompt_attention_mask` 0 on the padding (the padding is dropped; a row's `image_slot` counts it). The image
    goes before each row's token `image_slot` (`PromptLayout.image_slot`; 0: in front). `on_token` (one-row
    batches only) sees each kept token as soon as it is chosen, so a server can stream the report.
    `positions`: the decoder's kind of `position_ids` (`edgekit.positions`, recorded in the bundle's
    config.json); text positions when None."""
    options.validate()
    ids, pv = _as_batch(prompt_ids, pixel_values)
    batch = ids.shape[0]
    if on_token is not None and batch != 1:
        raise EdgekitError(f"on_token streams one sequence, got a batch of {batch}")
    mask = np.ones_like(ids) if prompt_attention_mask is None else np.asarray(prompt_attention_mask, np.int64)
    if mask.shape != ids.shape:
        raise EdgekitError(f"prompt_attention_mask shape {mask.shape} != prompt_ids shape {ids.shape}")
    slots = np.broadcast_to(np.asarray(image_slot, np.int64), (batch,))
    requests = []
    for row in range(batch):
        pad = int(ids.shape[1] - mask[row].sum())
        if mask[row, pad:].min(initial=1) != 1 or mask[row, :pad].max(initial=0) != 0:
            raise EdgekitError("prompt_attention_mask must pad on the left only")
        requests.append(
            Request(
                ids[row, pad:],
                options,
                None if pv is None else pv[row],
                image_slot=max(0, int(slots[row]) - pad),
                on_token=on_token,
            )
        )
    engine = Engine(backend, positions=positions, max_batch=batch)
    tickets = [engine.submit(r) for r in requests]
    engine.run()
    return [t.result() for t in tickets]


def generate(
    backend: Backend,
    pixel_values,
    prompt_ids,
    options: GenerationOptions,
    on_token: OnToken | None = None,
    image_slot: int = 0,
    positions: PositionScheme | None = None,
) -> GenerationResult:
    """Generate one report: `pixel_values` (1, frames, 1, H, W) or None, `prompt_ids` (1, seq) or (seq,), the
    image before token `image_slot`. `on_token(token_id, index)` is called for every token that ends up in
    `token_ids`, in order."""
    ids = np.asarray(prompt_ids)
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise EdgekitError(f"generate takes one prompt, got a batch of {ids.shape[0]}: use generate_batch")
    return generate_batch(
        backend, pixel_values, prompt_ids, options, on_token=on_token, image_slot=image_slot, positions=positions
    )[0]
