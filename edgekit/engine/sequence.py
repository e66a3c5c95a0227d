"""What one sequence is, below the engine and everything that calls it: request options and their bounds,
sampling, timings and results, the one-sequence backend protocol (`decode(embeds, mask, positions, past)`, which
`slots.PastKVSlots` adapts) and the prefill's layout of image features among the prompt's embeddings."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edgekit.errors import ConfigError, EdgekitError

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
    pad_token_id: int = 0  # kept for callers that set it; the engine feeds finished rows nothing

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
    wait_ms: float = 0.0  # from submission to the engine's admission (rows or KV budget were taken)
    decode_batch_mean: float = 1.0  # rows of its decode steps, on average (itself included): the batch it shared

    @property
    def meter_share(self) -> float:
        """The part of a whole-machine meter's window over this generation that is its own: not the wait for a row
        (others ran then), and of the rest one row's part of the batch it shared. Encode and prefill are shared by
        the same rows: a prompt's prefill chunks interleave with their decode steps."""
        whole = self.wait_ms + self.encode_ms + self.prefill_ms + self.decode_ms
        own = (whole - self.wait_ms) / max(1.0, self.decode_batch_mean)
        return own / whole if whole > 0 else 1.0


@dataclass
class GenerationResult:
    token_ids: list[int]
    stop_reason: str  # "stop_token" | "max_new_tokens" | "cancelled"
    timings: Timings
    cost: dict = field(default_factory=dict)  # what the target billed this sequence ({} when nothing is measured)


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
