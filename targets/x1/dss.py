"""Dynamic head sparsity (DSS): the per-token head mask of docs/x1/dss.md, computed on the host side.

Why here and not in the emulator: the policy is the scheduler's decision, the emulator only obeys the mask
(`Emulator.run(..., head_mask=...)`); keeping it a small pure-numpy object lets it be tested exactly and lets the
engine report what it reached against what was asked.

Per decode token, for layer l and query head h:

    c[l, h] = g[l, h] * r[l, h]

- g: head importance from the bundle's `head_importance` component (written by `edgekit/passes/heads.py`), each
  layer's weights normalised to average 1; all ones when the bundle has none.
- r: the head's share of its layer's attention output, `n[l,h] / sum_h' n[l,h']`, where `n[l,h]` is the norm of
  the head's attention output (what feeds o_proj) **at the last token it was computed**. The backend passes the
  previous call's norms; a head that was skipped reports nothing useful (its output is zero by definition), so
  its `n` is kept from the last call that computed it (the emulator reports NaN for it, zeros are treated the
  same way). Shares are taken over these last-known norms, so a
  skipped head does not make the others' shares look larger.

Candidates have `c < sensitivity_threshold`; one budget `k = floor(target * layers * heads)` over all layers;
skipped in increasing c (ties: lower layer, then lower head). Prefill and the first decode token run dense; a head
skipped `max_consecutive_skips` tokens in a row is forced active on the next one (its norm is refreshed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.errors import BundleError, ConfigError


def load_head_importance(path: str | Path, layers: int, heads: int) -> np.ndarray:
    """g (layers, heads) from a `head_importance.json`, each layer normalised to mean 1.

    A layer whose scores are all zero (or absent) gets uniform weights: there is nothing to rank it by."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        entries = doc["layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"head importance file is unreadable ({type(exc).__name__})", path) from exc
    if len(entries) != layers:
        raise BundleError(f"head importance has {len(entries)} layers, the decoder has {layers}", path)
    g = np.ones((layers, heads))
    for i, entry in enumerate(entries):
        scores = entry.get("score", entry.get("share")) if isinstance(entry, dict) else None
        if not isinstance(scores, list) or len(scores) != heads:
            raise BundleError(f"head importance layer {i}: field 'score' must list {heads} heads", path)
        s = np.asarray(scores, dtype=np.float64)
        if not np.all(np.isfinite(s)) or np.any(s < 0):
            raise BundleError(f"head importance layer {i}: scores must be finite and >= 0", path)
        if s.sum() > 0:
            g[i] = s / s.mean()
    return g


@dataclass
class MaskStats:
    """What the policy did over the decode tokens since the last `reset()`."""

    tokens: int = 0  # decode tokens a mask was made for (the dense first one included)
    heads_total: int = 0  # layers x heads x tokens
    heads_skipped: int = 0
    forced_active: int = 0  # anti-starvation wake-ups

    @property
    def skip_rate(self) -> float:
        return self.heads_skipped / self.heads_total if self.heads_total else 0.0

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "heads_total": self.heads_total,
            "heads_skipped": self.heads_skipped,
            "forced_active": self.forced_active,
            "skip_rate": self.skip_rate,
        }


class HeadMaskPolicy:
    """Callable `policy(layer_stats) -> mask` for `X1Backend(head_mask_fn=...)`: mask[l, h] True = compute.

    The engine calls `begin_prefill()` before a prefill call and `begin_decode()` before each decode call, so the
    policy knows the phase whatever the backend passes; `reset()` starts a new sequence."""

    def __init__(
        self,
        importance: np.ndarray,
        *,
        sparsity_target: float,
        sensitivity_threshold: float,
        max_consecutive_skips: int = 8,
    ):
        g = np.asarray(importance, dtype=np.float64)
        if g.ndim != 2 or g.size == 0:
            raise ConfigError(f"head importance must be (layers, heads), got shape {g.shape}")
        if not 0.0 <= sparsity_target < 1.0:
            raise ConfigError(f"field 'sparsity_target' = {sparsity_target!r} (expected 0 <= s < 1)")
        if not sensitivity_threshold >= 0.0:
            raise ConfigError(f"field 'sensitivity_threshold' = {sensitivity_threshold!r} (expected >= 0)")
        if max_consecutive_skips < 1:
            raise ConfigError(f"field 'max_consecutive_skips' = {max_consecutive_skips!r} (expected >= 1)")
        self.importance = g
        self.layers, self.heads = g.shape
        self.sparsity_target = float(sparsity_target)
        self.sensitivity_threshold = float(sensitivity_threshold)
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.budget = math.floor(self.sparsity_target * self.layers * self.heads)
        self._stats = MaskStats()
        self.reset()

    # phase ----------------------------------------------------------------------------------------------------
    # A decode token is opened by `begin_decode()` (dense unless the backend asks for a mask) and closed by the
    # next phase call or by reading `stats`, so a token the backend runs dense without asking (dss.md: the first
    # decode token) is still counted, and the anti-starvation counters see every token.
    def reset(self) -> None:
        """A new sequence: no statistics, every head fresh. Totals in `stats` are kept (see `reset_stats`)."""
        self._close()
        self._norms: np.ndarray | None = None  # last-known attention output norm per head
        self._last_mask = np.ones((self.layers, self.heads), bool)
        self._skipped_run = np.zeros((self.layers, self.heads), np.int64)
        self._decode_tokens = 0
        self._prefill = True
        self._open: np.ndarray | None = None  # the current decode token's mask, until closed

    def reset_stats(self) -> None:
        self._close()
        self._stats = MaskStats()

    @property
    def stats(self) -> MaskStats:
        self._close()
        return self._stats

    def begin_prefill(self) -> None:
        self.reset()

    def begin_decode(self) -> None:
        self._close()
        self._prefill = False
        self._decode_tokens += 1
        self._open = np.ones((self.layers, self.heads), bool)

    def _close(self) -> None:
        mask = getattr(self, "_open", None)
        if mask is None:
            return
        self._open = None
        self._skipped_run = np.where(mask, 0, self._skipped_run + 1)
        self._last_mask = mask
        self._stats.tokens += 1
        self._stats.heads_total += mask.size
        self._stats.heads_skipped += int((~mask).sum())

    # the policy -----------------------------------------------------------------------------------------------
    def observe(self, layer_stats) -> None:
        """Fold the previous call's per-head output norms in; heads that call did not compute keep their norm."""
        n = _as_norms(layer_stats, self.layers, self.heads)
        if n is None:
            return
        known = np.isfinite(n)  # the emulator reports NaN for a head it did not compute
        if self._norms is None:
            self._norms = np.where(known, n, 0.0)
        else:
            computed = self._last_mask & known
            self._norms[computed] = n[computed]

    def contributions(self) -> np.ndarray | None:
        """c = g * r over the last-known norms, or None before any statistics."""
        if self._norms is None:
            return None
        total = self._norms.sum(axis=1, keepdims=True)
        r = np.divide(self._norms, total, out=np.full_like(self._norms, 1.0 / self.heads), where=total > 0)
        return self.importance * r

    def __call__(self, layer_stats=None) -> np.ndarray:
        dense = np.ones((self.layers, self.heads), bool)
        if self._prefill or self._open is None:  # prefill: statistics passed now belong to an earlier sequence
            return dense
        self.observe(layer_stats)
        c = self.contributions()
        mask = dense
        if self._decode_tokens > 1 and c is not None and self.budget > 0:
            mask = self._select(c)
        self._open = mask
        return mask

    def _select(self, c: np.ndarray) -> np.ndarray:
        forced = self._skipped_run >= self.max_consecutive_skips
        self._stats.forced_active += int(forced.sum())
        cand = np.argwhere((c < self.sensitivity_threshold) & ~forced)  # row-major: (layer, head) order
        order = sorted(range(len(cand)), key=lambda i: (c[tuple(cand[i])], cand[i][0], cand[i][1]))
        mask = np.ones_like(c, dtype=bool)
        for i in order[: self.budget]:
            mask[tuple(cand[i])] = False
        return mask

    def report(self) -> dict:
        """The reached skip rate next to the target, for `last_stats` and benchmarks."""
        return {
            "sparsity_target": self.sparsity_target,
            "sensitivity_threshold": self.sensitivity_threshold,
            "budget_heads_per_token": self.budget,
            **self.stats.to_dict(),
        }


def _as_norms(layer_stats, layers: int, heads: int) -> np.ndarray | None:
    """Per-head norms (layers, heads) from what the backend passes: None, an array (layers, heads), a batch of
    them (batch, layers, heads: the largest over rows, so a head that matters to any row counts), or a list of
    per-layer arrays."""
    if layer_stats is None:
        return None
    if isinstance(layer_stats, dict):
        layer_stats = [layer_stats[k] for k in sorted(layer_stats)]
    n = np.asarray(layer_stats, dtype=np.float64)
    if n.ndim == 3:
        n = n.max(axis=0)
    if n.shape != (layers, heads):
        raise ConfigError(f"head statistics have shape {n.shape}, expected (layers, heads) = ({layers}, {heads})")
    return np.abs(n)
