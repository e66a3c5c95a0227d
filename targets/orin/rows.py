"""Rows of KV cache for the orin run side: one algorithm over two stores (numpy arrays for the ONNX Runtime
reference, device buffers for TensorRT), so the reference and the engines batch the same way.

The engine (`edgekit.engine.Engine`) hands out rows; a request's row holds its KV cache from its prefill to its
release. A row's cache is either *at home* (its own storage: contiguous, exactly its length) or *in the batch*. A
decode step over rows R gathers their caches into one past of (n, kv_heads, L, head_dim), left-padded with zeros to
the longest row's length L, with `attention_mask` 0 on the padding: keys are stored after RoPE at each row's own
positions, so where a row sits in the buffer changes nothing it computes. The step's present (L + 1 long) is the
next step's past for as long as the engine steps the same rows, which it does until one joins or leaves; then the
batch is handed back (each row's last `length` positions go home) and the new set is gathered. This is
`edgekit.engine.PastKVSlots`' algorithm, written per row so that TensorRT can run it on device buffers
(`device_kv.DeviceKV`) and ONNX Runtime on arrays (`onnx_backend.HostKV`).

Every call is checked against the decoder's profiles (`profiles.select_profile`) before the store is touched: a
shape the engines would refuse (more rows than the decode profile's maximum, a cache past `max_positions`, a second
prompt chunk on a non-empty cache) is refused with the profile's own line, and the rows stay as they were.

Billing: each row counts what it used (its image's tokens, its prompt, the tokens the decoder chose) and `release`
bills that row alone through `billing` (`estimate_billing.EstimateBilling`), so a report's bill does not depend on
what decoded beside it; {} without a billing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgekit import names
from edgekit.errors import EdgekitError

from .profiles import max_rows, select_profile


class KVStore(Protocol):
    """Where the rows' caches live. `RowBatcher` decides what moves when; a store only moves it."""

    def prefill(self, row: int, past_len: int, x: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The decoder over `row`'s home cache (`past_len` long) and `x` (1, seq, hidden); the present goes home.
        Returns logits (1, seq, vocab)."""

    def gather(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """The rows' home caches into the batch, row i left-padded with zeros to `max(lengths)`."""

    def step(self, past_len: int, x: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The decoder over the batch (`past_len` long); its present becomes the batch. Logits (n, 1, vocab)."""

    def scatter(self, rows: Sequence[int], lengths: Sequence[int], longest: int) -> None:
        """Row i's last `lengths[i]` positions of the batch (`longest` long) back home."""

    def forget(self, row: int) -> None:
        """`row`'s cache is no longer needed."""


@dataclass
class RowUse:
    """One row: its cache length and what it used, for its bill."""

    length: int = 0  # positions in the row's cache
    image_tokens: int | None = None  # the image's positions, None for a text-only request
    prompt_tokens: int = 0  # positions prefilled, less the image's
    decode_steps: int = 0
    prefilled: bool = False


@dataclass(frozen=True)
class Batch:
    """The rows whose caches are in the store's batch, its length (padding included) and its attention mask."""

    rows: tuple[int, ...]
    longest: int
    mask: np.ndarray  # (n, longest): 1 on each row's own positions, 0 on its left padding


def pad_mask(lengths: Sequence[int], longest: int) -> np.ndarray:
    """(n, longest) int64: row i's last lengths[i] positions 1, the padding before them 0."""
    mask = np.zeros((len(lengths), longest), np.int64)
    for i, n in enumerate(lengths):
        mask[i, longest - n :] = 1
    return mask


class RowBatcher:
    """The `SlotBackend` half the orin backends share (`prefill`, `step`, `release`, `max_rows`); they add the
    images and embeddings."""

    def __init__(self, store: KVStore, decoder_profiles: list[dict], *, kv_heads: int, head_dim: int, billing=None,
                 where=None):  # fmt: skip
        self.store = store
        self.profiles = decoder_profiles
        self.max_rows = max_rows(decoder_profiles)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.billing = billing
        self.where = where
        self.rows: dict[int, RowUse] = {}
        self.batch: Batch | None = None

    # the SlotBackend calls ---------------------------------------------------------------------------------------
    def images(self, rows: Sequence[int], image_tokens: int) -> None:
        """Each of `rows` got an image of `image_tokens` positions (for its bill)."""
        for row in rows:
            self._use(row).image_tokens = image_tokens

    def prefill(self, row: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        use = self._use(row)
        past = use.length
        mask = np.ones((1, past + x.shape[1]), np.int64)
        self._check(x.shape, mask.shape, np.shape(positions), 1, past)
        self._hand_back()
        logits = self.store.prefill(row, past, x, mask, positions)
        use.length = past + x.shape[1]
        use.prompt_tokens = use.length - (use.image_tokens or 0)
        use.prefilled = True
        return logits[0, -1]

    def step(self, rows: Sequence[int], x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        rows = tuple(rows)
        if len(set(rows)) != len(rows):
            raise EdgekitError(f"a decode step names a row twice: {list(rows)}")
        uses = []
        for row in rows:
            use = self.rows.get(row)
            if use is None or not use.prefilled:
                raise EdgekitError(f"row {row} has no KV cache to decode from: prefill it first")
            uses.append(use)
        lengths = [u.length for u in uses]
        batch = self.batch if self.batch is not None and self.batch.rows == rows else None
        same = batch is not None
        longest = batch.longest if batch is not None else max(lengths)
        held = batch.mask if batch is not None else pad_mask(lengths, longest)
        mask = np.concatenate([held, np.ones((len(rows), 1), np.int64)], axis=1)
        self._check(x.shape, mask.shape, np.shape(positions), len(rows), longest)  # before anything moves
        if not same:
            self._hand_back()
            self.store.gather(rows, lengths)
        logits = self.store.step(longest, x, mask, positions)
        self.batch = Batch(rows, longest + 1, mask)
        for use in uses:
            use.length += 1
            use.decode_steps += 1
        return logits[:, -1]

    def release(self, row: int) -> dict:
        """Forget `row` and bill it: its prompt, its image, and every token the decoder chose for it (the
        prefill's and one per step, the stop token included: each cost a decoder pass)."""
        self._hand_back()
        use = self.rows.pop(row, None)
        self.store.forget(row)
        if use is None or not use.prefilled or self.billing is None:
            return {}
        return self.billing.bill(
            prompt_tokens=use.prompt_tokens, new_tokens=1 + use.decode_steps, with_image=use.image_tokens is not None
        )

    # bookkeeping -----------------------------------------------------------------------------------------------
    def _use(self, row: int) -> RowUse:
        if not 0 <= row < self.max_rows:
            raise EdgekitError(f"row {row} is outside the engines' {self.max_rows} rows", self.where)
        return self.rows.setdefault(row, RowUse())

    def _hand_back(self) -> None:
        """The batch's caches back home (before a prefill, a different set of rows, or a release)."""
        if self.batch is None:
            return
        batch, self.batch = self.batch, None
        self.store.scatter(batch.rows, [self.rows[r].length for r in batch.rows], batch.longest)

    def _check(self, x_shape, mask_shape, positions_shape, batch: int, past_len: int) -> None:
        shapes = {
            names.INPUTS_EMBEDS: tuple(x_shape),
            names.ATTENTION_MASK: tuple(mask_shape),
            names.POSITION_IDS: tuple(positions_shape),
            names.past_key(0): (batch, self.kv_heads, past_len, self.head_dim),
        }
        select_profile(self.profiles, shapes, names.DECODER_ROLE, self.where)
