"""One sequence's state on the emulated X1: its KV cache, its DSS policy and head statistics, and what it cost.

Why one object per row: with continuous batching several requests decode on one backend at once, and nothing of
one may leak into another. DSS is the subtle part: its policy keeps per-sequence counters (anti-starvation runs,
last-known head norms) and the first decode token of each sequence runs dense (docs/x1/dss.md), so each row has
its own policy and statistics, and a row's head mask depends only on its own history: alone or beside others,
it skips the same heads and writes the same tokens.
"""

from __future__ import annotations

import numpy as np

from .accounting import SequenceCost
from .dss import HeadMaskPolicy
from .kvcache import KVCache


class RowState:
    """`kv`: its cache after the last call (None until its first prefill, and always without KV caching: `seq`
    then holds its embeddings and positions so far, which every call recomputes); `length`: positions so far;
    `decode_tokens`: decode calls since its prefill; `mask_fn`: what chooses its head masks (its own policy, a
    caller's function, or None: dense); `layer_stats`: the last-known attention-output norm per (layer, head)."""

    def __init__(self, layers: int, heads: int, policy: HeadMaskPolicy | None, mask_fn=None):
        self.kv: KVCache | None = None
        self.seq: tuple[np.ndarray, np.ndarray] | None = None
        self.length = 0
        self.decode_tokens = 0
        self.policy = policy
        self.mask_fn = policy if policy is not None else mask_fn
        self.layer_stats = np.full((layers, heads), np.nan, np.float32)
        self.last_mask: np.ndarray | None = None
        self.cost = SequenceCost()
        self.runs: list = []  # (phase, RunResult), only when the backend keeps runs (profiling)

    @property
    def started(self) -> bool:
        """True from its first prefill on: an embedding lookup now is a decoded token's."""
        return self.length > 0

    def start(self) -> None:
        """A new sequence on this row: its policy begins afresh (prefill runs dense)."""
        self.kv, self.seq, self.length, self.decode_tokens, self.last_mask = None, None, 0, 0, None
        self.layer_stats = np.full_like(self.layer_stats, np.nan)
        if self.policy is not None:
            self.policy.begin_prefill()

    def next_mask(self) -> np.ndarray | None:
        """The head mask of its next decode token (None: dense). The first decode token runs dense: the policy
        has no statistics yet (prefill's belong to many positions)."""
        if self.policy is not None:
            self.policy.begin_decode()
        mask = None
        if self.mask_fn is not None and self.decode_tokens >= 1:
            mask = np.asarray(self.mask_fn(self.layer_stats.copy()), bool)
        self.last_mask = mask
        return mask

    def observe(self, head_norms) -> None:
        """Fold a call's per-head output norms in (NaN: the head was not computed, its last norm stays)."""
        if self.mask_fn is not None and head_norms is not None:  # only a policy reads them (built lazily)
            self.layer_stats = np.where(np.isnan(head_norms), self.layer_stats, head_norms).astype(np.float32)


def policy_like(policy: HeadMaskPolicy) -> HeadMaskPolicy:
    """A fresh policy with `policy`'s importance and settings: one per row."""
    return HeadMaskPolicy(
        policy.importance,
        sparsity_target=policy.sparsity_target,
        sensitivity_threshold=policy.sensitivity_threshold,
        max_consecutive_skips=policy.max_consecutive_skips,
    )
