"""What the engine asks of a target's run side: rows of KV cache that requests join and leave.

A *slot backend* keeps the KV cache itself, one row per request in flight, and takes three calls that name rows:
a prefill (a prompt, or a chunk of one, appended to a row's cache), a batched decode step (one token for each of
several rows at once, each at its own length) and a release. The engine (`scheduler.Engine`) decides which rows
run when; the backend decides how a row's cache is stored (the cpu target: preallocated buffers bound with I/O
binding; x1: the emulator's SRAM-bank cache, per row).

Targets whose run side still speaks the older one-sequence protocol (`decode(embeds, mask, positions, past)`
returning the new cache) are wrapped by `PastKVSlots`: each row's cache is held here, and a step over rows of
different lengths left-pads them into one batch with `attention_mask` 0 on the padding, as the portable decoder
graph takes. Such a backend batches only if it says so (`batch_rows = True`: its `decode` holds no per-sequence
state); otherwise the engine runs it one request at a time and bills the request with its `take_cost()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from .sequence import take_cost


@runtime_checkable
class SlotBackend(Protocol):
    """Rows are small integers the engine hands out (`0 .. max_rows - 1`)."""

    max_rows: int  # rows it can hold at once (the engine never asks for more)

    def encode_images(self, pixel_values: np.ndarray, rows: Sequence[int]) -> np.ndarray:
        """(n, frames, 1, H, W) -> (n, image_tokens, hidden), row i's image for `rows[i]` (cost is billed to it)."""

    def embed(self, input_ids: np.ndarray, rows: Sequence[int]) -> np.ndarray:
        """(n, seq) int64 -> (n, seq, hidden)."""

    def prefill(self, row: int, inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Append (1, seq, hidden) to `row`'s cache (empty at a request's first chunk); the logits (vocab,) of the
        chunk's last position."""

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """One token for each of `rows` ((n, 1, hidden), positions (n, 1) or M-RoPE's (3, n, 1)), each row at its
        own cache length; logits (n, vocab)."""

    def release(self, row: int) -> dict:
        """Forget `row`'s cache; what the row cost (an emulator's cycles and energy), {} when nothing is measured."""

    # Optional: `step_tokens(rows, tokens, positions) -> logits (n, vocab)`, a decode step from each row's token id
    # and text position (ints), which the engine calls instead of `embed` + `step` where a backend has it: the cpu
    # target writes them straight into its bound inputs (its logits are valid until the next step).
    # Optional: `decode_greedy(rows, tokens, positions, steps, stops, more) -> [tokens of each step]`, up to `steps`
    # greedy steps in one call, ending after a step that chose a token in `stops` or when `more()` is false (the
    # engine's multi-step runs: its own work per step is paid once a run). Without it, one call per step.
    # Optional: `prefill_rows(rows, inputs_embeds, position_ids) -> logits (n, vocab)`, the whole first prompts of
    # several new rows in one call ((n, seq, hidden); every row the same positions, (n, seq) or (3, n, seq)); the
    # engine groups waiting prompts for it (`Engine._prefill_group`). Without it, one prefill call per row.


def kv_bytes_per_token(backend) -> int:
    """KV bytes one token of one row holds (the engine's admission budget), 0 when the backend does not say."""
    return int(getattr(backend, "kv_bytes_per_token", 0) or 0)


class PastKVSlots:
    """A `SlotBackend` over a backend of the one-sequence protocol (`edgekit.generate.Backend`)."""

    def __init__(self, backend, max_rows: int = 8):
        self.backend = backend
        self.batched = bool(getattr(backend, "batch_rows", False))
        self.max_rows = max_rows if self.batched else 1
        self._past: dict[int, list] = {}  # row -> its cache as the backend returned it ((1, kv, len, hd) pairs)
        self._len: dict[int, int] = {}
        # the last step's rows, past (per layer: K and V) and mask
        self._batch: tuple[tuple[int, ...], Sequence[tuple[np.ndarray, ...]], np.ndarray] | None = None
        num_layers = getattr(backend, "num_layers", None)
        kv_heads, head_dim = getattr(backend, "kv_heads", None), getattr(backend, "head_dim", None)
        if num_layers and kv_heads and head_dim:  # float32 key and value per layer
            self.kv_bytes_per_token = 2 * num_layers * kv_heads * head_dim * 4
        if getattr(backend, "weight_bytes", None) is not None:  # what a step streams, for the bandwidth rule
            self.weight_bytes = backend.weight_bytes

    # images and tokens ----------------------------------------------------------------------------------------
    def encode_images(self, pixel_values, rows):
        return self.backend.encode_images(pixel_values)

    def embed(self, input_ids, rows):
        return self.backend.embed(input_ids)

    # the cache ---------------------------------------------------------------------------------------------
    def prefill(self, row, inputs_embeds, position_ids):
        self._sync()
        past = self._past.get(row)
        length = self._len.get(row, 0) + inputs_embeds.shape[1]
        mask = np.ones((1, length), np.int64)
        logits, present = self.backend.decode(inputs_embeds, mask, position_ids, past)
        self._past[row], self._len[row] = present, length
        return logits[0, -1]

    def step(self, rows, inputs_embeds, position_ids):
        rows = tuple(rows)
        if len(rows) == 1:  # no padding to manage: the row's own cache, as one sequence
            self._sync()
            row = rows[0]
            self._len[row] += 1
            mask = np.ones((1, self._len[row]), np.int64)
            logits, self._past[row] = self.backend.decode(inputs_embeds, mask, position_ids, self._past[row])
            return logits[:, -1]
        if self._batch is None or self._batch[0] != rows:
            self._sync()
            self._batch = (rows, *self._pad(rows))
        _, past, mask = self._batch
        mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], axis=1)
        for row in rows:
            self._len[row] += 1
        logits, present = self.backend.decode(inputs_embeds, mask, position_ids, past)
        self._batch = (rows, present, mask)
        return logits[:, -1]

    def release(self, row):
        self._sync()
        self._past.pop(row, None)
        self._len.pop(row, None)
        if self.batched:
            return {}
        return take_cost(self.backend)

    # padding -----------------------------------------------------------------------------------------------
    def _pad(self, rows: tuple[int, ...]) -> tuple[list[tuple[np.ndarray, ...]], np.ndarray]:
        """The rows' caches left-padded to the longest, and the mask that hides the padding."""
        longest = max(self._len[r] for r in rows)
        mask = np.zeros((len(rows), longest), np.int64)
        layers: list[tuple[np.ndarray, ...]] = []
        for layer in range(len(self._past[rows[0]])):
            pair = []
            for which in (0, 1):
                first = np.asarray(self._past[rows[0]][layer][which])
                out = np.zeros((len(rows), first.shape[1], longest, first.shape[3]), first.dtype)
                for i, r in enumerate(rows):
                    n = self._len[r]
                    out[i, :, longest - n :] = np.asarray(self._past[r][layer][which])[0]
                pair.append(out)
            layers.append(tuple(pair))
        for i, r in enumerate(rows):
            mask[i, longest - self._len[r] :] = 1
        return layers, mask

    def _sync(self) -> None:
        """Hand the last batched step's cache back to its rows (each row's own positions, padding dropped)."""
        if self._batch is None:
            return
        rows, past, _ = self._batch
        self._batch = None
        for i, r in enumerate(rows):
            n = self._len[r]
            self._past[r] = [
                (np.asarray(k)[i : i + 1, :, -n:].copy(), np.asarray(v)[i : i + 1, :, -n:].copy()) for k, v in past
            ]


def as_slots(backend, max_rows: int = 8) -> SlotBackend:
    """The backend itself when it keeps rows, else the `PastKVSlots` wrapper."""
    if isinstance(backend, SlotBackend):
        return backend
    return PastKVSlots(backend, max_rows)
