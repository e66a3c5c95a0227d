"""The scheduler: a bounded queue in front of a fixed number of model workers, apart from the HTTP routes.

Routes only submit work and await a future; generation runs in worker threads so the event loop keeps answering
health checks and accepting (or refusing, with 503 + Retry-After) while a report is being written. Durable jobs
are marked running/finished in the job store here; on drain, queued jobs are left in the store for the next start.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgekit.errors import EdgekitError

from .jobs import JobStore
from .metrics import Metrics
from .variants import VariantRegistry

log = logging.getLogger("edgekitd")


class QueueFullError(EdgekitError):
    code = "queue_full"
    http_status = 503


class ShuttingDownError(EdgekitError):
    code = "shutting_down"
    http_status = 503


@dataclass
class Work:
    """One report to write. `job_id` set: a durable job (state lives in the store); else a synchronous request."""

    study_path: Path
    prompt: str
    options: dict
    variant: str | None = None
    job_id: str | None = None
    study: object | None = None  # the already-ingested Study, when the route validated it up front
    limits: object | None = None
    cleanup: Path | None = None  # removed after the work ends (a durable job's input files)
    stream: object | None = None  # a streams.TokenStream fed with text deltas as the report is generated
    future: cf.Future = field(default_factory=cf.Future)
    accepted: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, registry: VariantRegistry, store: JobStore, metrics: Metrics, *, workers: int = 1,
                 max_queue: int = 16):
        self.registry, self.store, self.metrics = registry, store, metrics
        self.max_queue = max_queue
        self._queue: queue.Queue[Work | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._running = 0
        self._idle = threading.Condition(self._lock)
        self._stopping = False
        self._threads = [threading.Thread(target=self._worker, name=f"edgekitd-worker-{i}", daemon=True)
                         for i in range(workers)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def depth(self) -> int:
        return self._pending

    @property
    def running(self) -> int:
        return self._running

    def has_room(self) -> bool:
        return not self._stopping and self._pending < self.max_queue

    def reserve(self) -> None:
        """Hold a queue slot before the upload is read, so a full queue refuses at once and memory stays bounded."""
        with self._lock:
            if self._stopping:
                raise ShuttingDownError("the daemon is shutting down; retry shortly")
            if self._pending >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting); retry later")
            self._pending += 1
            self.metrics.queue_depth.set(self._pending)

    def release(self) -> None:
        with self._lock:
            self._pending -= 1
            self.metrics.queue_depth.set(self._pending)

    def submit(self, work: Work, *, reserved: bool = False, force: bool = False) -> cf.Future:
        """Queue `work` in a slot from `reserve()`, or take one now (`force`: recovered jobs, past the bound).
        Work without a variant is pinned to the one active now: a switch does not move accepted work."""
        if work.variant is None:
            work.variant = self.registry.active
        if not reserved:
            with self._lock:
                if not force and self._pending >= self.max_queue:
                    self.metrics.rejected.inc()
                    raise QueueFullError(f"the queue is full ({self.max_queue} waiting); retry later")
                self._pending += 1
                self.metrics.queue_depth.set(self._pending)
        self._queue.put(work)
        return work.future

    def stop_accepting(self) -> None:
        """From the first SIGTERM on, start nothing new: queued durable jobs stay queued for the next start
        (without this, queued jobs kept running while the HTTP server closed its connections)."""
        with self._lock:
            self._stopping = True

    def drain(self, timeout: float) -> bool:
        """Stop taking work, let running reports finish (up to `timeout`); queued durable jobs stay queued."""
        with self._lock:
            self._stopping = True
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
            if work is not None and not work.future.done():
                work.future.set_exception(ShuttingDownError("the daemon is shutting down; retry shortly"))
        return drained

    def _worker(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            with self._lock:
                self._pending -= 1
                self.metrics.queue_depth.set(self._pending)
                if self._stopping:  # left for the next start if durable; refused if synchronous
                    if not work.future.done():
                        work.future.set_exception(ShuttingDownError("the daemon is shutting down; retry shortly"))
                    continue
                self._running += 1
                self.metrics.running.set(self._running)
            try:
                self._run(work)
            finally:
                with self._idle:
                    self._running -= 1
                    self.metrics.running.set(self._running)
                    self._idle.notify_all()

    def _run(self, work: Work) -> None:
        self.metrics.queue_wait.observe(time.perf_counter() - work.accepted)
        if work.job_id:
            self.store.mark_running(work.job_id)
        try:
            with self.registry.hold(work.variant) as loaded:
                out = self._report(work, loaded)
            if work.job_id:
                self.store.finish(work.job_id, result=out)
            work.future.set_result(out)
        except EdgekitError as err:
            self.metrics.reports.labels(self._label(work), err.code).inc()
            log.info("report %s failed: %s", work.job_id or "sync", err.code)  # the code only: reasons may name files
            if work.job_id:
                self.store.finish(work.job_id, error={**err.to_json(), "status": err.http_status})
            work.future.set_exception(err)
        except Exception as exc:  # a bug: keep the traceback in the log, give the client a stable code
            self.metrics.reports.labels(self._label(work), "internal_error").inc()
            log.exception("report %s crashed", work.job_id or "sync")
            if work.job_id:
                self.store.finish(work.job_id, error={"code": "internal_error", "message": type(exc).__name__,
                                                      "status": 500})
            work.future.set_exception(exc)
        finally:
            if work.stream is not None:
                work.stream.close()  # after an error too: readers then see the job's final state
            if work.cleanup is not None:
                shutil.rmtree(work.cleanup, ignore_errors=True)

    def _label(self, work: Work) -> str:
        """A metrics label only once the name is known to be configured (clients choose the name)."""
        return work.variant if work.variant in self.registry.specs else "-"

    def _report(self, work: Work, loaded) -> dict:
        from edgekit.generate import GenerationOptions
        from edgekit.ingest import load_study

        from .streams import token_sink

        t0 = time.perf_counter()
        variant = loaded.name
        study = work.study if work.study is not None else load_study(work.study_path, limits=work.limits)
        reporter = loaded.reporter
        gen = reporter.generation_config
        opts = GenerationOptions(**{"max_new_tokens": gen.get("max_new_tokens", 128), **work.options})
        if not opts.stop_token_ids:
            opts.stop_token_ids = [gen["eos_token_id"]]
        on_token = finish = None
        if work.stream is not None:
            on_token, finish = token_sink(reporter.tokenizer, work.stream)
        report = reporter.report(study, work.prompt, opts, on_token=on_token)
        out = {**report.to_dict(), "variant": variant}
        out["timings"]["queue_ms"] = (t0 - work.accepted) * 1e3
        self.metrics.reports.labels(variant, "ok").inc()
        self.metrics.tokens.labels(variant).inc(report.timings.get("new_tokens", 0))
        self.metrics.report_latency.labels(variant).observe(time.perf_counter() - t0)
        log.info("report %s variant=%s study=%s tokens=%d total_ms=%.0f", work.job_id or "sync", variant,
                 report.study, report.timings.get("new_tokens", 0), out["timings"]["total_ms"])
        if finish is not None:
            finish(report.text)  # the last delta (if any) and done, before the job reads as finished
        return out
