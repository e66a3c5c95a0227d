"""What reaches edgekitd's log: scrubbed of patient data whoever logs, and floods cut down to a line per interval.

Installed once at start on every handler (the root's and uvicorn's own), so a library's record, an exception's
text and a child logger's message pass the same filters (`edgekit.ingest.phi.ScrubExceptions`). A process out of
file descriptors makes asyncio log every failed accept() with its traceback, several times a second: 186 MB in 40 s
under a slowloris. `RateLimit` lets one record per logger and message through per interval and says how many
were held back.
"""

from __future__ import annotations

import logging
import threading
import time

from edgekit.ingest.phi import install_handlers

# Loggers whose records come in floods from outside: the event loop's accept errors, uvicorn's connection errors.
FLOODING = ("asyncio", "uvicorn.error", "opentelemetry")  # the OTLP exporter warns on every retry
INTERVAL_S = 10.0


class RateLimit(logging.Filter):
    def __init__(self, interval_s: float = INTERVAL_S):
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith(FLOODING):
            return True
        key = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.interval_s) < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} like it held back in the last {self.interval_s:.0f} s)"
        return True


def install(loggers: tuple[str, ...] = ("", "uvicorn", "uvicorn.access")) -> None:
    """Both filters on every handler of `loggers` (the root and uvicorn's, which do not propagate)."""
    handlers = [h for name in loggers for h in logging.getLogger(name).handlers]
    install_handlers(handlers)
    for handler in handlers:
        if not any(isinstance(f, RateLimit) for f in handler.filters):
            handler.addFilter(RateLimit())
