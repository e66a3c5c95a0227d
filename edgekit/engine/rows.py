"""A request's state inside the engine (`scheduler.Engine`), and which first prompts may share a prefill call.

Apart from the scheduler because both are facts about requests, not about the order of a step: what a row holds
from admission to its end, and the one rule for grouping prompts (`CpuSlotBackend.prefill_rows` and the x1
backend's take a first prompt of several rows only when every row has the same length and positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .request import Ticket
from .sequence import Timings


@dataclass(eq=False)
class EngineRow:
    """A request in the engine: its row of KV cache, its prompt until prefilled, its tokens and timings."""

    ticket: Ticket
    row: int
    kv_reserved: int
    rng: np.random.Generator
    stops: frozenset[int]
    embeds: np.ndarray | None = None  # the prompt with its image, (1, L, hidden), until prefilled
    positions: np.ndarray | None = None  # its prefill positions, (1, L) or (3, 1, L)
    cursor: int = 0  # prompt positions prefilled so far
    length: int = 0  # positions in this row's KV cache
    next_pos: int = 0  # the next token's position
    token: int = 0  # the last token chosen (fed at the next step)
    generated: list[int] = field(default_factory=list)
    reason: str | None = None
    t_admitted: float = 0.0
    t_encoded: float = 0.0
    t_first: float = 0.0
    encode_s: float = 0.0
    steps: int = 0  # decode steps taken
    step_rows: int = 0  # rows of those steps, summed (itself included): their mean is the batch it shared

    def stepped(self, rows: int) -> None:
        """One decode step taken, one of `rows`: one more position and token."""
        self.length += 1
        self.next_pos += 1
        self.steps += 1
        self.step_rows += rows

    def timings(self, now: float) -> Timings:
        """Where its time went, at its end (`now`)."""
        decode_s = now - self.t_first if self.t_first else 0.0
        return Timings(
            encode_ms=self.encode_s * 1e3,
            prefill_ms=((self.t_first or now) - (self.t_encoded or now)) * 1e3,
            decode_ms=decode_s * 1e3,
            decode_tokens_per_s=self.steps / decode_s if self.steps and decode_s > 0 else 0.0,
            wait_ms=(self.t_admitted - self.ticket.submitted) * 1e3,
            decode_batch_mean=self.step_rows / self.steps if self.steps else 1.0,
        )

    def prompt(self) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's embeddings and prefill positions, which a row has from its layout until it is prefilled."""
        if self.embeds is None or self.positions is None:
            raise RuntimeError(f"row {self.row} has no prompt to prefill")
        return self.embeds, self.positions


def shared_prefill(prefilling: list[EngineRow], budget: int | None) -> list[EngineRow]:
    """The oldest of `prefilling`, and beside it the waiting first prompts that can share its call: each whole
    prompt not started (none chunked yet), not cancelled, of the same length and positions, while the group holds at
    most `budget` tokens (None: no bound). Only the oldest when it is part-way through its prompt."""
    head = prefilling[0]
    if head.cursor:
        return [head]
    embeds, positions = head.prompt()
    seq = embeds.shape[1]
    group = [head]
    for r in prefilling[1:]:
        if budget is not None and (len(group) + 1) * seq > budget:
            break
        if r.cursor or r.ticket.cancelled or r.embeds is None or r.positions is None:
            continue
        if r.embeds.shape[1] == seq and np.array_equal(r.positions, positions):
            group.append(r)
    return group
