"""The daemon's parts wired together, and its life: start (load + warm + recover jobs), reload, drain.

Kept apart from the HTTP routes (`api.py`) and from process concerns (`main.py`) so tests and the bench script can
drive the same object.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from .config import DaemonConfig, load_config
from .jobs import JobStore
from .metrics import Metrics
from .notify import Notifier
from .scheduler import Scheduler, Work
from .streams import StreamHub
from .variants import VariantRegistry

log = logging.getLogger("edgekitd")


class Daemon:
    def __init__(self, cfg: DaemonConfig, *, notifier: Notifier | None = None, overrides: dict | None = None):
        self.cfg = cfg
        self.overrides = overrides or {}
        self.notifier = notifier or Notifier()
        self.metrics = Metrics()
        Path(cfg.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.store = JobStore(cfg.state_dir)
        self.registry: VariantRegistry | None = None
        self.scheduler: Scheduler | None = None
        self.ready = False
        self.failed: str | None = None
        self.recovered = 0
        self.streams = StreamHub()
        self._heartbeat = time.monotonic()
        self._reload_lock = threading.Lock()
        self._stopped = threading.Event()

    # --- status -------------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        log.info("%s", text)
        self.notifier.status(text)

    def beat(self) -> None:
        """Called from the event loop; the watchdog pings only while the loop keeps beating."""
        self._heartbeat = time.monotonic()

    def loop_alive(self) -> bool:
        limit = max(5.0, (self.notifier.watchdog_usec or 0) / 1e6)
        return time.monotonic() - self._heartbeat < limit

    # --- life -----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Blocking: build/load/warm the active variant, start workers, requeue unfinished jobs, then READY=1."""
        try:
            self.registry = VariantRegistry(self.cfg, say=self.say, on_change=self._loaded_changed)
            self.registry.get()
            self.scheduler = Scheduler(self.registry, self.store, self.metrics, workers=self.cfg.workers,
                                       max_queue=self.cfg.max_queue)
            self.scheduler.start()
            purged = self.store.purge(self.cfg.job_retention_s)
            for job in self.store.recover():
                self.scheduler.submit(self.work_for(job), force=True)
                self.recovered += 1
        except Exception as exc:
            self.failed = str(exc)
            log.error("start failed: %s", exc)
            self.notifier.send(f"STATUS=start failed: {type(exc).__name__}", "ERRNO=1")
            raise
        self.ready = True
        self.notifier.ready(self.summary(f"recovered {self.recovered} job(s), purged {purged}"))
        self.notifier.start_watchdog(self.loop_alive)
        threading.Thread(target=self._keep_alive, name="edgekitd-keep-alive", daemon=True).start()

    def _keep_alive(self) -> None:
        """Unload idle variants; checks a few times per keep-alive period (at most every 5 s)."""
        while not self._stopped.wait(min(5.0, max(0.05, abs(self.cfg.keep_alive_s) / 4))):
            for name in self.registry.unload_idle():
                self.notifier.status(self.summary(f"unloaded idle variant {name}"))

    def _loaded_changed(self, loaded: set[str]) -> None:
        self.metrics.set_loaded(loaded, set(self.registry.specs) if self.registry else loaded)

    def work_for(self, job) -> Work:
        return Work(study_path=Path(job.input), prompt=job.prompt, options=job.options, variant=job.variant,
                    job_id=job.id, limits=self.limits(), cleanup=self.store.job_dir(job.id) / "input",
                    stream=self.streams.open(job.id))

    def limits(self):
        from edgekit.ingest import IngestLimits

        c = self.cfg
        return IngestLimits(max_files=c.max_files, max_frames=c.max_frames, max_pixels=c.max_pixels,
                            max_bytes=max(c.max_upload_bytes, 1) * 8, video_max_frames=c.video_max_frames)

    def summary(self, extra: str = "") -> str:
        active = self.registry.active if self.registry else "-"
        return f"serving variant {active}" + (f"; {extra}" if extra else "")

    def reload(self) -> None:
        """SIGHUP: reread the config file; variants still listed stay loaded; the active one is warm before READY."""
        with self._reload_lock:
            self.notifier.reloading()
            try:
                cfg = load_config(self.cfg.source, self.overrides)
                self.registry.configure(cfg)
                self.registry.get()
                self.scheduler.max_queue = cfg.max_queue
                self.cfg = cfg
                log.info("config reloaded")
            except Exception as exc:  # keep serving with the old config
                log.error("reload failed, keeping the previous config: %s", exc)
            self.notifier.ready(self.summary("reloaded"))

    def stop(self) -> None:
        self.ready = False
        self._stopped.set()
        self.notifier.stopping()
        if self.scheduler is not None:
            drained = self.scheduler.drain(self.cfg.drain_timeout_s)
            counts = self.store.counts()
            log.info("stopped: drained=%s, jobs left queued for the next start: %d", drained, counts.get("queued", 0))
        self.notifier.close()

    def evidence_path(self, job_id: str) -> Path:
        return self.store.job_dir(job_id) / "evidence.json"

    def save_evidence(self, job_id: str, evidence: list[dict]) -> None:
        path = self.evidence_path(job_id)
        path.write_text(json.dumps(evidence))
        path.chmod(0o600)
