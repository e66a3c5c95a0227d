"""Autoregressive generation over any backend (cpu/ORT, the x1 emulator, the torch reference).

The loop is the same everywhere, so targets differ only in the math of their three calls: image features are put
among the prompt's embeddings at the prompt's image slot (`edgekit.prompt.PromptLayout`: in front for
radreport-tiny, where the chat template's image token stands for an imported VLM), one prefill call fills the KV
cache, then one decode call per new token.
Greedy at temperature 0; otherwise temperature + top-p (nucleus) sampling from a seeded numpy Generator, so a
seed reproduces a report on every target.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edgekit.errors import ConfigError, EdgekitError
from edgekit.positions import PositionScheme

KV = list[tuple[np.ndarray, np.ndarray]]
# Bounds every caller shares (CLI flags, the daemon's form, the library): beyond them a request is a mistake.
MAX_NEW_TOKENS = 4096
MAX_TEMPERATURE = 5.0
OnToken = Callable[[int, int], None]  # (token_id, index in the generated text), called as each token is kept


class Backend(Protocol):
    def encode_images(self, pixel_values: np.ndarray) -> np.ndarray: ...

    def embed(self, input_ids: np.ndarray) -> np.ndarray: ...

    def decode(
        self, inputs_embeds: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: KV | None
    ) -> tuple[np.ndarray, KV]: ...


def take_cost(backend) -> dict:
    """What the backend measured for the sequence just generated (an emulator's cycles and energy), and a fresh
    start for the next; {} for backends that measure nothing beyond wall time."""
    take = getattr(backend, "take_cost", None)
    return take() if take is not None else {}


@dataclass
class GenerationOptions:
    """`temperature == 0` is greedy. `top_p` keeps the smallest set of most likely tokens whose mass reaches it.
    `stop_token_ids` end a sequence; the stop token itself is not part of `token_ids`."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = field(default_factory=list)
    pad_token_id: int = 0  # fed to rows of a batch that already stopped

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ConfigError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Timings:
    encode_ms: float
    prefill_ms: float
    decode_ms: float
    decode_tokens_per_s: float  # tokens from decode calls (all but the first, which prefill yields) per second


@dataclass
class GenerationResult:
    token_ids: list[int]
    stop_reason: str  # "stop_token" | "max_new_tokens"
    timings: Timings


DEFAULT_MAX_NEW_TOKENS = 128  # when a bundle's generation config names none


def request_options(
    generation_config: Mapping[str, Any],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> GenerationOptions:
    """A request's sampling choices over a bundle's generation config: the one merge every caller uses (the
    reporter, the CLI through it, edgekitd). Stops at the config's `eos_token_id` when it names one."""
    g = generation_config
    return GenerationOptions(
        max_new_tokens=g.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS) if max_new_tokens is None else max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=[g["eos_token_id"]] if "eos_token_id" in g else [],
    )


def next_tokens(logits: np.ndarray, options: GenerationOptions, rng: np.random.Generator) -> np.ndarray:
    """One token per row of `logits` (batch, vocab): argmax, or a temperature/top-p sample."""
    if options.temperature == 0:
        return logits.argmax(-1)
    out = np.empty(logits.shape[0], dtype=np.int64)
    for row, z in enumerate(logits.astype(np.float64) / options.temperature):
        order = np.argsort(-z, kind="stable")  # ties go to the lower id, as argmax does
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        # keep tokens until the mass before them reaches top_p: the top token always stays
        keep = min(len(p), int(np.searchsorted(np.cumsum(p), options.top_p, side="left")) + 1)
        p = p[:keep] / p[:keep].sum()
        out[row] = order[rng.choice(keep, p=p)]
    return out


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


def place_image(
    text: np.ndarray, text_mask: np.ndarray, image: np.ndarray | None, image_slot: int | Sequence[int] = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The prefill's (inputs_embeds, attention_mask): each row's image features inserted before its text token
    `image_slot` (one index for all rows, or one per row: a left-padded row counts its padding), the mask 1 on
    them. The one place a prefill is assembled; parity checks call it too."""
    if image is None:
        return text, text_mask
    batch, seq = text_mask.shape
    slots = np.broadcast_to(np.asarray(image_slot, np.int64), (batch,))
    if slots.min() < 0 or slots.max() > seq:
        raise EdgekitError(f"image_slot {image_slot} is outside the prompt's {seq} tokens")
    if image.shape[0] != batch:
        raise EdgekitError(f"{image.shape[0]} images for {batch} prompts")

    def insert(rows: np.ndarray, span: np.ndarray) -> np.ndarray:
        return np.stack([np.concatenate([r[:s], p, r[s:]]) for r, p, s in zip(rows, span, slots)])

    return insert(text, image), insert(text_mask, np.ones(image.shape[:2], np.int64))


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
    """Generate for a batch (`pixel_values` None: text only). Prompts of different lengths are left-padded, with
    `prompt_attention_mask` 0 on the padding; positions count only kept tokens, as in training. The image goes
    before each row's token `image_slot` (`PromptLayout.image_slot`; 0: in front). All rows share one timing.
    `on_token` (one-row batches only) sees each kept token as soon as it is chosen, so a server can stream the
    report. `positions`: the decoder's kind of `position_ids` (`edgekit.positions`, recorded in the bundle's
    config.json); text positions when None."""
    options.validate()
    scheme = positions or PositionScheme()
    ids, pv = _as_batch(prompt_ids, pixel_values)
    batch = ids.shape[0]
    if on_token is not None and batch != 1:
        raise EdgekitError(f"on_token streams one sequence, got a batch of {batch}")
    stops = np.asarray(list(options.stop_token_ids), dtype=np.int64)
    rng = np.random.default_rng(options.seed)

    t0 = time.perf_counter()
    image = backend.encode_images(pv) if pv is not None else None
    t1 = time.perf_counter()
    text = backend.embed(ids)
    text_mask = np.ones_like(ids) if prompt_attention_mask is None else np.asarray(prompt_attention_mask, np.int64)
    if text_mask.shape != ids.shape:
        raise EdgekitError(f"prompt_attention_mask shape {text_mask.shape} != prompt_ids shape {ids.shape}")
    x, mask = place_image(text, text_mask, image, image_slot)
    position_ids, next_pos = scheme.prefill(mask, image_slot, 0 if image is None else image.shape[1])
    logits, past = backend.decode(x, mask, position_ids, None)
    token = next_tokens(logits[:, -1], options, rng)
    t2 = time.perf_counter()

    generated = [[] for _ in range(batch)]
    reasons: list[str | None] = [None] * batch
    steps = 0
    while True:
        for row in range(batch):
            if reasons[row] is None:
                if token[row] in stops:
                    reasons[row] = "stop_token"
                else:
                    generated[row].append(int(token[row]))
                    if on_token is not None:
                        on_token(generated[row][-1], len(generated[row]) - 1)
                    if len(generated[row]) >= options.max_new_tokens:
                        reasons[row] = "max_new_tokens"
        if all(r is not None for r in reasons):
            break
        fed = np.where([r is None for r in reasons], token, options.pad_token_id).astype(np.int64)[:, None]
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        logits, past = backend.decode(backend.embed(fed), mask, scheme.step(next_pos), past)
        next_pos = next_pos + 1
        token = next_tokens(logits[:, -1], options, rng)
        steps += 1
    t3 = time.perf_counter()

    decode_s = t3 - t2
    timings = Timings(
        encode_ms=(t1 - t0) * 1e3,
        prefill_ms=(t2 - t1) * 1e3,
        decode_ms=decode_s * 1e3,
        decode_tokens_per_s=steps / decode_s if steps and decode_s > 0 else 0.0,
    )
    return [GenerationResult(generated[r], reasons[r], timings) for r in range(batch)]


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
