"""What the policy reads each tick: power from the best meter the board has, battery and AC state, thermal
headroom to the nearest trip point, queue depth and the recent p95 of reports. All from `signals_root` (`/` on a
device, a fixture tree with the real sysfs layout in tests and the bench).

The same sampler bills each report's energy (`Reporter(meter=...)`), so a report's `energy_j` and the policy's
power reading come from one source, named in both.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np

from .config import DaemonConfig
from .metrics import Metrics
from .policy import Signals

if TYPE_CHECKING:
    from .queue import WorkQueue
    from .runner import ReportRunner

log = logging.getLogger("edgekitd")


class SignalReader:
    def __init__(self, cfg: DaemonConfig, metrics: Metrics):
        from edgekit.energy.discover import discover_meters
        from edgekit.energy.sampler import Sampler

        self.root = cfg.signals_root
        self.metrics = metrics
        self.meter = Sampler(discover_meters(self.root))
        self.queue: WorkQueue | None = None
        self.runner: ReportRunner | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def attach(self, queue: WorkQueue, runner: ReportRunner) -> None:
        self.queue, self.runner = queue, runner

    def start(self) -> None:
        self.meter.start()

    def stop(self) -> None:
        self.meter.stop()

    def _once(self, what: str, exc: Exception) -> None:
        if what not in self._warned:  # a missing or broken file is logged once, not every tick
            self._warned.add(what)
            log.warning("signals: cannot read %s (%s); going on without it", what, exc)

    def read(self) -> Signals:
        from edgekit.energy.power_supply import battery_state
        from edgekit.energy.thermal import headroom_c, read_zones

        with self._lock:
            power = source = None
            reading = self.meter.latest()
            if reading is not None and reading.watts is not None:
                power, source = reading.watts, reading.source
                for rail, watts in (reading.rails or {"total": reading.watts}).items():
                    self.metrics.power.labels(rail, reading.source).set(watts)
            battery = None
            try:
                battery = battery_state(self.root)
            except (OSError, ValueError) as exc:
                self._once("power supplies", exc)
            headroom = None
            try:
                found = headroom_c(read_zones(self.root))
                headroom = found[0] if found is not None else None
            except (OSError, ValueError) as exc:
                self._once("thermal zones", exc)
            recent = list(self.runner.recent_ms) if self.runner is not None else []
            return Signals(
                power_w=power,
                power_source=source,
                battery_pct=battery.percent if battery is not None else None,
                on_battery=bool(battery and battery.on_battery),
                thermal_headroom_c=headroom,
                queue_depth=self.queue.depth if self.queue is not None else 0,
                recent_p95_ms=float(np.percentile(recent, 95)) if len(recent) >= 5 else None,
            )
