"""The work queue: a bounded queue in front of a fixed number of model worker threads. It queues and runs; what
running means (the report, the job's state, its metrics) is the `run` callable it is given.

Routes reserve a slot before reading an upload, so a full queue refuses at once (503 + Retry-After) and memory
stays bounded; generation runs in worker threads so the event loop keeps answering health checks meanwhile. From
the first SIGTERM on nothing new starts: queued durable jobs stay in the store for the next start, and synchronous
callers still waiting get a clean 503.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from edgekit.errors import EdgekitError

from .metrics import Metrics
from .work import Work

log = logging.getLogger("edgekitd")


class QueueFullError(EdgekitError):
    code = "queue_full"
    http_status = 503


class ShuttingDownError(EdgekitError):
    code = "shutting_down"
    http_status = 503


class WorkQueue:
    def __init__(self, run: Callable[[Work], None], metrics: Metrics, *, workers: int = 1, max_queue: int = 16):
        self.run, self.metrics = run, metrics
        self.max_queue = max_queue
        self._queue: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._running = 0
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._worker, name=f"edgekitd-worker-{i}", daemon=True) for i in range(workers)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def depth(self) -> int:
        return self._pending

    @property
    def running(self) -> int:
        return self._running

    def reserve(self) -> None:
        """Hold a queue slot before the upload is read; give it back with `release` or use it in `submit`."""
        with self._lock:
            if self._stopping:
                raise ShuttingDownError("the daemon is shutting down; retry shortly")
            self._take_slot()

    def release(self) -> None:
        with self._lock:
            self._set_pending(self._pending - 1)

    def submit(self, work: Work, *, reserved: bool = False, force: bool = False) -> None:
        """Queue `work` in a slot from `reserve()`, or take one now (`force`: recovered jobs, past the bound)."""
        if not reserved:
            with self._lock:
                if force:
                    self._set_pending(self._pending + 1)
                else:
                    self._take_slot()
        self._queue.put(work)

    def _take_slot(self) -> None:
        """Under the lock."""
        if self._pending >= self.max_queue:
            self.metrics.rejected.inc()
            raise QueueFullError(f"the queue is full ({self.max_queue} waiting); retry later")
        self._set_pending(self._pending + 1)

    def _set_pending(self, n: int) -> None:
        self._pending = n
        self.metrics.queue_depth.set(n)

    def stop_accepting(self) -> None:
        """From the first SIGTERM on, start nothing new (without this, queued jobs kept running while the HTTP
        server closed its connections)."""
        with self._lock:
            self._stopping = True

    def drain(self, timeout: float) -> bool:
        """Stop taking work, let running reports finish (up to `timeout`); True if none was still running."""
        self.stop_accepting()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._running and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.0, deadline - time.monotonic()))
            drained = self._running == 0
        while True:  # synchronous callers still waiting get a clean 503
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                _refuse(work)
        return drained

    def _worker(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            with self._lock:
                self._set_pending(self._pending - 1)
                if self._stopping:  # left for the next start if durable; refused if synchronous
                    _refuse(work)
                    continue
                self._running += 1
                self.metrics.running.set(self._running)
            self.metrics.queue_wait.observe(time.perf_counter() - work.accepted)
            try:
                self.run(work)
            except Exception as exc:  # `run` answers every outcome itself; this is a bug in it
                log.exception("running work crashed")
                if not work.future.done():
                    work.future.set_exception(exc)
            finally:
                with self._idle:
                    self._running -= 1
                    self.metrics.running.set(self._running)
                    self._idle.notify_all()


def _refuse(work: Work) -> None:
    if not work.future.done():
        work.future.set_exception(ShuttingDownError("the daemon is shutting down; retry shortly"))
