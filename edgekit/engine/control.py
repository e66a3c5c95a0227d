"""Batch-size controllers: how many rows the engine lets decode together, decided from what the steps measured.

- `FixedBatch`: the configured maximum, always (the default until a measurement says otherwise).
- `BandwidthRule`: the rule of the design edgekit grew from (seed figures: "memory-bandwidth-aware batching"):
  above 85% of the memory-bandwidth limit cut the batch to 0.6x, below 40% raise it 1.5x. Utilisation is bytes
  moved per step (weights once, each row's KV cache, as the backend reports them) over the step's time, against
  the backend's bandwidth limit (x1: its off-chip paths, near-memory weight stream plus DRAM, with the emulator's
  exact bytes and emulated step time; cpu: a measured copy bandwidth).
- `LatencyTarget`: holds the time per decode step (= per token of every row) under a target: shrink by one row
  when the recent p90 step exceeds it, grow by one when it is below 80% of it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class StepStats:
    """What the engine's recent steps measured (the controllers' input; also `Engine.stats` for benches)."""

    window: int = 32
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    encodes: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=32))  # (rows, seconds, bytes or None)

    def record_step(self, rows: int, seconds: float, bytes_moved: float | None = None) -> None:
        self.steps += 1
        self.tokens += rows
        self.recent.append((rows, seconds, bytes_moved))

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens

    def step_seconds(self, quantile: float = 0.5) -> float | None:
        if not self.recent:
            return None
        times = sorted(s for _, s, _ in self.recent)
        return times[min(len(times) - 1, int(quantile * len(times)))]

    def bandwidth(self) -> float | None:
        """Bytes per second over the recent steps that reported their bytes."""
        moved = [(b, s) for _, s, b in self.recent if b is not None and s > 0]
        if not moved:
            return None
        return sum(b for b, _ in moved) / sum(s for _, s in moved)


class BatchController(Protocol):
    name: str

    def batch_size(self, stats: StepStats) -> int: ...


@dataclass
class FixedBatch:
    size: int
    name: str = "fixed"

    def batch_size(self, stats: StepStats) -> int:
        return self.size


@dataclass
class BandwidthRule:
    """Cut to `cut`x above `high` of `limit_bytes_per_s`, raise `raise_`x below `low` (the design's 0.6 / 0.85 /
    1.5 / 0.40), within [1, max_size]. Decides once per `every` steps, so one noisy step does not swing it."""

    max_size: int
    limit_bytes_per_s: float
    high: float = 0.85
    low: float = 0.40
    cut: float = 0.6
    raise_: float = 1.5
    every: int = 8
    name: str = "bandwidth"
    size: int = 0
    _seen: int = 0
    utilisation: float | None = None

    def __post_init__(self) -> None:
        self.size = self.size or self.max_size

    def batch_size(self, stats: StepStats) -> int:
        if stats.steps - self._seen >= self.every:
            self._seen = stats.steps
            bw = stats.bandwidth()
            if bw is not None and self.limit_bytes_per_s > 0:
                self.utilisation = bw / self.limit_bytes_per_s
                if self.utilisation > self.high:
                    self.size = max(1, math.floor(self.size * self.cut))
                elif self.utilisation < self.low:
                    self.size = min(self.max_size, max(self.size + 1, math.floor(self.size * self.raise_)))
        return self.size


@dataclass
class LatencyTarget:
    """Keep the p90 decode step under `target_s` (a per-token latency every row sees)."""

    max_size: int
    target_s: float
    every: int = 8
    name: str = "latency"
    size: int = 0
    _seen: int = 0

    def __post_init__(self) -> None:
        self.size = self.size or self.max_size

    def batch_size(self, stats: StepStats) -> int:
        if stats.steps - self._seen >= self.every:
            self._seen = stats.steps
            p90 = stats.step_seconds(0.9)
            if p90 is not None:
                if p90 > self.target_s:
                    self.size = max(1, self.size - 1)
                elif p90 < 0.8 * self.target_s:
                    self.size = min(self.max_size, self.size + 1)
        return self.size


CONTROLLERS = ("fixed", "bandwidth", "latency")
_COPY_BANDWIDTH: float | None = None


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """This machine's memory bandwidth as a large copy reaches it (bytes read + written per second, best of
    `repeats`); measured once per process. The cpu target's bandwidth limit: what streaming weights can reach."""
    global _COPY_BANDWIDTH
    if _COPY_BANDWIDTH is None:
        import time

        import numpy as np

        src = np.ones(nbytes // 8, np.float64)
        dst = np.empty_like(src)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        _COPY_BANDWIDTH = 2 * src.nbytes / best
    return _COPY_BANDWIDTH


def make_controller(name: str, max_batch: int, backend=None, latency_target_s: float = 0.05) -> BatchController:
    """The controller `name` (one of `CONTROLLERS`) for an engine of `max_batch` rows over `backend`, whose
    `bandwidth_limit_bytes_per_s` (an emulated machine's DRAM) bounds the bandwidth rule; a measured copy
    bandwidth (`copy_bandwidth`) where the backend names none."""
    if name == "fixed":
        return FixedBatch(max_batch)
    if name == "latency":
        return LatencyTarget(max_batch, latency_target_s)
    if name == "bandwidth":
        limit = getattr(backend, "bandwidth_limit_bytes_per_s", None) or copy_bandwidth()
        return BandwidthRule(max_batch, float(limit))
    from edgekit.errors import ConfigError

    raise ConfigError(f"unknown batch controller {name!r} (known: {', '.join(CONTROLLERS)})")
