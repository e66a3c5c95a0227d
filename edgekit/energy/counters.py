"""Cumulative energy counters (RAPL's `energy_uj`, NVML's total energy) turned into monotonic totals.

A hardware counter wraps: RAPL's `energy_uj` returns to 0 after `max_energy_range_uj` (about 262 kJ on many Intel
packages: some 40 minutes at 100 W), so a delta is `now - prev` plus the range when `now < prev`. That is only
right if the counter is read at least once per wrap period; the sampler reads it every interval. A counter that
goes backwards without a range to wrap at (NVML's, after a driver reload) has been reset, and is refused.
"""

from __future__ import annotations

from edgekit.energy.reading import MeterReadError


def wrapped_delta(prev: int, now: int, wrap_range: int | None) -> int:
    """Counts from `prev` to `now`, once around `wrap_range` when the counter wrapped. Raises MeterReadError when
    the counter ran backwards with nothing to wrap at, or read beyond its range."""
    if now < 0 or prev < 0:
        raise MeterReadError(f"counter read negative ({prev} -> {now})")
    if wrap_range is not None and (now > wrap_range or prev > wrap_range):
        raise MeterReadError(f"counter read {max(prev, now)}, beyond its range {wrap_range}")
    if now >= prev:
        return now - prev
    if wrap_range is None:
        raise MeterReadError(f"counter ran backwards ({prev} -> {now}): reset (driver reloaded?)")
    return wrap_range - prev + now


class Unwrapper:
    """A raw counter in, a total since the first reading out (in the counter's units)."""

    def __init__(self, first: int, wrap_range: int | None):
        self.last, self.wrap_range, self.total = first, wrap_range, 0

    def update(self, raw: int) -> int:
        self.total += wrapped_delta(self.last, raw, self.wrap_range)
        self.last = raw
        return self.total
