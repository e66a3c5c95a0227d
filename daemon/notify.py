"""sd_notify without libsystemd: one datagram per message to `$NOTIFY_SOCKET`, plus the watchdog pinger.

The protocol is a newline-separated list of `KEY=VALUE` sent as one AF_UNIX datagram; a leading `@` in the socket
path names the abstract namespace (a NUL byte on the wire). Outside systemd there is no `NOTIFY_SOCKET` and every
call is a no-op, so the daemon runs the same way under a terminal, a test or a container.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping

log = logging.getLogger("edgekitd")


def _address(path: str) -> str | bytes:
    return b"\0" + path[1:].encode() if path.startswith("@") else path


class Notifier:
    """Sends READY/STATUS/WATCHDOG/STOPPING; `enabled` is False when not started by a notify-aware manager."""

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.path = env.get("NOTIFY_SOCKET") or None
        self.watchdog_usec = _watchdog_usec(env)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pinger: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def send(self, *lines: str) -> bool:
        if self.path is None:
            return False
        payload = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(payload, _address(self.path))
                return True
            except OSError as exc:  # the manager went away: keep serving, say so once per failure
                log.warning("sd_notify failed: %s", exc.strerror or exc)
                return False

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def reloading(self) -> None:
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str = "draining in-flight work") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def start_watchdog(self, healthy=lambda: True) -> None:
        """Ping WATCHDOG=1 every half `WATCHDOG_USEC` while `healthy()` says so (a wedged loop then gets restarted)."""
        if self.path is None or not self.watchdog_usec or self._pinger is not None:
            return
        interval = self.watchdog_usec / 2e6

        def ping() -> None:
            while not self._stop.wait(interval):
                if healthy():
                    self.send("WATCHDOG=1")

        self.send("WATCHDOG=1")
        self._pinger = threading.Thread(target=ping, name="edgekitd-watchdog", daemon=True)
        self._pinger.start()

    def close(self) -> None:
        self._stop.set()
        if self._pinger is not None:
            self._pinger.join(timeout=2)
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _watchdog_usec(env) -> int | None:
    """`WATCHDOG_USEC`, honoured only when `WATCHDOG_PID` (if set) is this process, as sd_watchdog_enabled does."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    return usec if usec > 0 else None
