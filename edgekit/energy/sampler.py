"""A sampler thread that integrates a meter's power into joules, and per-report windows over it.

Why a thread: a report takes a fraction of a second to a few seconds and a power meter reads only "now", so the
energy of a report is the integral of samples taken while it runs. The sampler reads its meter every
`interval_s` (default 50 ms, the seed's rate) and keeps one running total of joules: the trapezoid between two
power readings, or the exact difference of a counter meter's joules (RAPL, NVML, the CPU-time estimate). A window
(`with sampler.window() as w:`) takes a reading when it opens and one when it closes, so its edges are exact
and windows may overlap (concurrent reports each see the whole machine's energy while they ran).

A meter that raises, disappears or reads garbage (not a finite number in [0, max_watts], a counter running
backwards) is dropped for good, logged once, and the next meter in the list takes over; the gap between the
last good reading and the new meter's first is bridged at the last good power. A window that spans the switch
carries the weaker label of the two and names the failed meter in `fell_back_from`. When no meter is left,
windows read None: no figure rather than a made-up one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from edgekit.energy.reading import EnergyReading, Meter, MeterReadError, PowerReading, weakest
from edgekit.errors import ConfigError

log = logging.getLogger("edgekit.energy")

DEFAULT_INTERVAL_S = 0.05
MAX_WATTS = 10_000.0  # above any single edge machine: a reading beyond it is garbage


@dataclass(frozen=True)
class Mark:
    """Where the running total stood at one reading: a window's opening edge."""

    t: float
    joules: float
    segment: int
    samples: int


class Window:
    """One report's energy: `.reading` (an EnergyReading, or None when no meter was working) once closed, and
    its `.joules`, `.seconds` and `.source` (None until then)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.reading: EnergyReading | None = None
        self._start: Mark | None = None

    def __enter__(self) -> Window:
        self._start = self.sampler.mark()
        return self

    def __exit__(self, *exc) -> None:
        self.reading = self.sampler.since(self._start)

    @property
    def t_start(self) -> float | None:
        """`time.monotonic()` of the opening reading (the meter's own clock), None if no meter worked then."""
        return self._start.t if self._start else None

    @property
    def t_end(self) -> float | None:
        return self._start.t + self.reading.seconds if self._start and self.reading else None

    @property
    def joules(self) -> float | None:
        return self.reading.joules if self.reading else None

    @property
    def seconds(self) -> float | None:
        return self.reading.seconds if self.reading else None

    @property
    def source(self) -> str | None:
        return self.reading.source if self.reading else None


class Sampler:
    """Samples `meters[0]` (falling back along the list) every `interval_s` while started. Thread-safe: the
    thread, windows and `sample()` share one lock, and a meter is only ever read under it."""

    def __init__(self, meters: Sequence[Meter], interval_s: float = DEFAULT_INTERVAL_S, *, max_watts=MAX_WATTS):
        if not meters:
            raise ValueError("a sampler needs at least one meter")
        if not 0.001 <= interval_s <= 60:
            raise ConfigError(f"the sampling interval must be between 1 ms and 60 s, got {interval_s * 1e3:g} ms")
        self.meters = list(meters)
        self.interval_s, self.max_watts = float(interval_s), float(max_watts)
        self.failed: list[tuple[str, str]] = []  # (source, why), in the order they failed
        self.thread_cpu_s = 0.0  # CPU time the sampling threads have used, all starts (for the overhead bench)
        self._lock = threading.Lock()
        self._active = 0  # index into meters; len(meters) when none is left
        self._segments: list[str] = []  # the source of each stretch of the running total
        self._joules = 0.0
        self._samples = 0
        self._last: PowerReading | None = None  # last good reading of the active meter
        self._bridge: PowerReading | None = None  # last good reading of a meter that then failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sample()

    # --- reading ----------------------------------------------------------------------------------------------
    @property
    def source(self) -> str | None:
        """The label readings carry now; None when every meter has failed."""
        return self.meters[self._active].source if self._active < len(self.meters) else None

    def latest(self) -> PowerReading | None:
        """The last good reading (the policy's power signal), without reading the meter again."""
        return self._last

    def sample(self) -> PowerReading | None:
        with self._lock:
            return self._sample()

    def _sample(self) -> PowerReading | None:
        while self._active < len(self.meters):
            meter = self.meters[self._active]
            try:
                r = meter.read()
                why = r.problem(self.max_watts) or self._counter_problem(r)
            except (MeterReadError, OSError, ValueError) as e:
                why = str(e) or type(e).__name__
            else:
                if why is None:
                    self._integrate(r)
                    return r
            self._fall_back(meter, why)
        return None

    def _counter_problem(self, r: PowerReading) -> str | None:
        last = self._last
        if last is not None and last.energy_j is not None and r.energy_j is not None and r.energy_j < last.energy_j:
            return f"energy counter ran backwards ({last.energy_j:.3f} J -> {r.energy_j:.3f} J)"
        if r.watts is None and r.energy_j is None:
            return "a reading with neither power nor energy"
        return None

    def _integrate(self, r: PowerReading) -> None:
        last = self._last
        if last is None:  # the first reading of this meter: start its segment, bridge from the one that failed
            self._segments.append(r.source)
            b = self._bridge
            if b is not None and b.watts is not None:
                self._joules += b.watts * max(0.0, r.t - b.t)
            self._bridge = None
        elif last.energy_j is not None and r.energy_j is not None:
            self._joules += r.energy_j - last.energy_j
        elif last.watts is not None and r.watts is not None:
            self._joules += 0.5 * (last.watts + r.watts) * max(0.0, r.t - last.t)
        self._last = r
        self._samples += 1

    def _fall_back(self, meter: Meter, why: str) -> None:
        self.failed.append((meter.source, why))
        self._active += 1
        nxt = self.source
        log.warning(
            "energy meter %s failed (%s); %s",
            meter.source,
            why,
            f"falling back to {nxt}" if nxt else "no meter left: reports carry no energy figure",
        )
        if self._last is not None:
            self._bridge = self._last
        self._last = None

    # --- windows ----------------------------------------------------------------------------------------------
    def window(self) -> Window:
        return Window(self)

    def mark(self) -> Mark | None:
        with self._lock:
            r = self._sample()
            return None if r is None else Mark(r.t, self._joules, len(self._segments) - 1, self._samples)

    def since(self, start: Mark | None) -> EnergyReading | None:
        """The energy from `start` (a `mark()`) to now; None when no meter worked at either end."""
        with self._lock:
            r = self._sample()
            if r is None or start is None:
                return None
            sources = self._segments[start.segment :]
            failed = tuple(dict.fromkeys(sources[:-1]))  # every segment but the active one ended in a failure
            return EnergyReading(
                joules=self._joules - start.joules,
                seconds=r.t - start.t,
                source=weakest(sources) if len(set(sources)) > 1 else sources[-1],
                samples=self._samples - start.samples + 1,
                fell_back_from=failed,
            )

    # --- the thread -------------------------------------------------------------------------------------------
    def start(self) -> Sampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="edgekit-energy-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        base, cpu0 = self.thread_cpu_s, time.thread_time()  # summed over every start()
        deadline = time.monotonic()
        while True:
            deadline += self.interval_s
            now = time.monotonic()
            if deadline < now:  # a slow read: skip the missed ticks rather than burst to catch up
                deadline = now
            if self._stop.wait(deadline - now):
                break
            self.sample()
            self.thread_cpu_s = base + time.thread_time() - cpu0
        self.thread_cpu_s = base + time.thread_time() - cpu0

    def describe(self) -> dict:
        return {
            "interval_s": self.interval_s,
            "source": self.source,
            "meters": [m.describe() for m in self.meters],
            "failed": [{"source": s, "reason": why} for s, why in self.failed],
        }
