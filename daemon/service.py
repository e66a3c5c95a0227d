"""The service: the daemon's parts wired together, its life (start, reload, drain), and the one object routes call.

Routes parse and answer; what a report request means happens once for both upload routes, in `submit.py` (the
variant pinned, the upload ingested, the prompt fitted, the work built whole); received studies become jobs in
`received.py`. Kept apart from HTTP (`api.py`, `routes.py`) and from the process (`main.py`) so tests and the
bench drive this same object.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from edgekit.errors import EdgekitError

from . import cpu_share, telemetry
from .config import DaemonConfig, load_config
from .delivery import DeliveryWorker
from .dicomweb import BodyChunks, StoreResult, StowService
from .dimse import StorageScp
from .forms import ReportForm
from .intake import Ingestor
from .jobs import DeliveryStore, Job, JobStore
from .metrics import Metrics
from .notify import Notifier
from .policy_loop import PolicyLoop, PolicyNotConfiguredError, settings_from_json
from .queue import WorkQueue
from .received import QuarantinedError, ReceivedStudies
from .rollout import Rollout
from .runner import ReportRunner
from .signals import SignalReader
from .streams import StreamHub
from .studies import StudyInbox
from .submit import Accepted, Submissions, Submitted
from .uploads import InsufficientStorageError
from .variants import Loaded, VariantRegistry

log = logging.getLogger("edgekitd")

JOB_ID = re.compile(r"^[0-9a-f]{32}$")


class NotReadyError(EdgekitError):
    code = "not_ready"
    http_status = 503


class JobNotFoundError(EdgekitError):
    code = "job_not_found"
    http_status = 404


class StowDisabledError(EdgekitError):
    code = "stow_disabled"
    http_status = 404


class Daemon:
    def __init__(self, cfg: DaemonConfig, *, notifier: Notifier | None = None, overrides: dict[str, Any] | None = None):
        self.cfg = cfg
        self.overrides: dict[str, Any] = overrides or {}
        self.notifier = notifier or Notifier()
        self.metrics = Metrics()
        self.tracing = telemetry.setup(cfg.telemetry)  # [telemetry] or OTEL_*: off unless asked (docs/telemetry.md)
        Path(cfg.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.store = JobStore(cfg.state_dir)
        self.streams = StreamHub()
        self.submissions = Submissions(self)
        self.ingestor = Ingestor(cfg, self.metrics.ingest_memory.set, self.metrics.ingest_wait.observe)
        self.registry: VariantRegistry | None = None
        self.queue: WorkQueue | None = None
        self.runner: ReportRunner | None = None
        self.policy: PolicyLoop | None = None
        self.rollout: Rollout | None = None
        self.signals: SignalReader | None = None
        self.ready = False
        self.failed: str | None = None
        self.recovered = 0
        self._heartbeat = time.monotonic()
        self._reload_lock = threading.Lock()
        self._stopped = threading.Event()
        # DICOM networking: received instances wait in the inbox until their study is complete, then become jobs;
        # finished jobs' reports go out through the delivery worker.
        self.deliveries = DeliveryStore(self.store)
        inbox_dir = Path(cfg.state_dir) / "inbox"
        self.received = ReceivedStudies(self)
        self.inbox = StudyInbox(
            inbox_dir,
            lambda: self.cfg.dicom.quiet_period_s,
            telemetry.traced_receive(self.received.receive),
            max_attempts=lambda: self.cfg.max_attempts,
            quarantine=self.received.quarantine,
            min_free=lambda: self.cfg.min_free_bytes,
        )
        self.stow = StowService(self.inbox, self.metrics)
        self.delivery = DeliveryWorker(self.store, self.deliveries, lambda: self.cfg.dicom, self.metrics)
        self.delivery.calling_ae = cfg.dicom.ae_title
        self.scp: StorageScp | None = None
        if cfg.dicom.scp:  # bound here, so a port in use is a config error before anything loads
            self.scp = StorageScp(cfg.dicom, self.inbox, self.metrics)
            self.scp.start()

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

    def summary(self, extra: str = "") -> str:
        active = self.registry.active if self.registry else "-"
        return f"serving variant {active}" + (f"; {extra}" if extra else "")

    def readiness(self) -> dict[str, Any] | None:
        """What `/v2/health/ready` shows once serving; None while loading (or after a failed start)."""
        if not self.ready or self.queue is None or self.registry is None:
            return None
        q = self.queue
        free = free_bytes(self.cfg.state_dir)
        if free is not None and free < self.cfg.min_free_bytes:
            return None
        return {
            "ready": True,
            "active": self.registry.active,
            "queue_depth": q.depth,
            "running": q.running,
            "max_queue": q.max_queue,
            "recovered_jobs": self.recovered,
            "pending_studies": self.inbox.pending(),
            "state_dir_free_bytes": free,
            "ingest_memory_bytes": self.ingestor.memory.held,
        }

    def not_ready_status(self) -> str:
        """Why readiness is 503: loading, a failed start, or a state directory nearly full."""
        if self.failed:
            return self.failed
        if self.ready:
            return "state_dir_full"
        return "loading"

    # --- life -----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Blocking: build/load/warm the active variant, start workers, requeue unfinished jobs, then READY=1."""
        try:
            processes = self.ingestor.workers.processes if self.ingestor.workers is not None else 0
            log.info("%s", cpu_share.plan(self.cfg, processes))
            registry = self.registry = VariantRegistry(self.cfg, say=self.say, on_change=self._loaded_changed)
            rollout = self.rollout = Rollout(
                self.cfg.state_dir, registry, lambda: self.cfg.rollout, self._count_step, telemetry.event
            )
            rollout.recover()  # an unfinished rollout goes back before anything loads; each variant's live slot
            self.signals = SignalReader(self.cfg, self.metrics)
            self.signals.start()
            registry.meter = self.signals.meter
            runner = self.runner = ReportRunner(registry, self.store, self.metrics, self.ingestor)
            runner.observe = rollout.observe_report
            runner.point_of = self._served_point
            self.delivery.on_outcome = rollout.observe_delivery
            self.queue = WorkQueue(runner, self.metrics, workers=self.cfg.workers, max_queue=self.cfg.max_queue)
            self.signals.attach(self.queue, runner)
            warming = threading.Thread(target=self.ingestor.warm, name="edgekitd-ingest-warm", daemon=True)
            if _reads_studies(registry):  # the ingest processes start while the model loads (text models need none)
                warming.start()
            if self.cfg.policy is not None:  # the policy's first decision picks the variant that loads first
                self.policy = PolicyLoop(self.cfg, registry, self.metrics, self.signals.read)
                self.policy.tick()
            else:
                registry.get()
            self.queue.start()
            purged = self.store.purge(self.cfg.job_retention_s)
            for job in self.store.recover():
                if job.attempts >= self.cfg.max_attempts:
                    self._quarantine_job(job)
                    continue
                self.queue.submit(self.submissions.work_for(job, job.variant or registry.active), force=True)
                self.recovered += 1
            if warming.is_alive():  # READY once they are up (a start that hangs holds it up to START_TIMEOUT_S)
                warming.join()
        except Exception as exc:
            self.failed = str(exc)
            log.error("start failed: %s", exc)
            self.notifier.send(f"STATUS=start failed: {type(exc).__name__}", "ERRNO=1")
            raise
        self.ready = True
        studies = self.inbox.start()
        self.delivery.start()
        self.notifier.ready(
            self.summary(f"recovered {self.recovered} job(s) and {studies} received stud(ies), purged {purged}")
        )
        self.notifier.start_watchdog(self.loop_alive)
        threading.Thread(target=self._keep_alive, args=(registry,), name="edgekitd-keep-alive", daemon=True).start()
        threading.Thread(target=self._rollout_ticks, name="edgekitd-rollout", daemon=True).start()
        if self.policy is not None:
            threading.Thread(target=self.policy.run, args=(self._stopped,), name="edgekitd-policy", daemon=True).start()

    def _keep_alive(self, registry: VariantRegistry) -> None:
        """Unload idle variants; checks a few times per keep-alive period (at most every 5 s)."""
        while not self._stopped.wait(min(5.0, max(0.05, abs(self.cfg.keep_alive_s) / 4))):
            for name in registry.unload_idle():
                self.notifier.status(self.summary(f"unloaded idle variant {name}"))

    def _rollout_ticks(self) -> None:
        """Canary windows that ran out of time, and bundles dropped in [rollout] drop_dir, once a second."""
        while not self._stopped.wait(1.0):
            try:
                if self.rollout is not None:
                    self.rollout.tick()
            except Exception:  # noqa: BLE001 - a bug in one tick must not end the rollouts; it is logged
                log.exception("rollout tick failed")

    def _served_point(self, variant: str) -> str | None:
        """The policy's point serving `variant` now (a report's trace names it), if any."""
        point = self.policy.point if self.policy is not None else None
        return point.id if point is not None and point.settings.get("variant") == variant else None

    def _count_step(self, variant: str, step: str) -> None:
        self.metrics.rollout_steps.labels(variant, step).inc()

    def _loaded_changed(self, loaded: set[str]) -> None:
        self.metrics.set_loaded(loaded, set(self.registry.specs) if self.registry else loaded)
        if self.registry is not None:  # called under the registry's (reentrant) lock, in the thread that loaded
            self.metrics.set_engine_rows(self.registry.rows_max())

    def reload(self) -> None:
        """SIGHUP: reread the config file; variants still listed stay loaded; the active one is warm before READY."""
        with self._reload_lock:
            self.notifier.reloading()
            try:
                cfg = load_config(self.cfg.source, self.overrides)
                registry, queue = self.serving()
                registry.configure(cfg)
                registry.get()
                queue.max_queue = cfg.max_queue
                self.ingestor.configure(cfg)
                self.cfg = cfg
                log.info("config reloaded")
            except Exception as exc:  # noqa: BLE001 - keep serving with the old config, whatever went wrong
                log.error("reload failed, keeping the previous config: %s", exc)
            self.notifier.ready(self.summary("reloaded"))

    def stop_accepting(self) -> None:
        """The first SIGTERM: not ready, STOPPING=1, and nothing new starts (at once, before connections drain)."""
        self.ready = False
        self.notifier.stopping()
        if self.queue is not None:
            self.queue.stop_accepting()

    def stop(self) -> None:
        """The end of the lifespan: drain running reports (queued jobs stay queued), close what the daemon opened."""
        self.stop_accepting()
        self._stopped.set()
        if self.scp is not None:
            self.scp.stop()
        self.inbox.stop()
        self.delivery.stop()
        if self.queue is not None:
            drained = self.queue.drain(self.cfg.drain_timeout_s)
            counts = self.store.counts()
            log.info("stopped: drained=%s, jobs left queued for the next start: %d", drained, counts.get("queued", 0))
        self.ingestor.close()
        if self.signals is not None:
            self.signals.stop()
        if self.tracing:
            telemetry.shutdown()  # the spans still buffered go out
        self.notifier.close()

    # --- requests -------------------------------------------------------------------------------------------------
    def serving(self) -> tuple[VariantRegistry, WorkQueue]:
        if not self.ready or self.registry is None or self.queue is None:
            raise NotReadyError("the model is still loading; retry shortly")
        return self.registry, self.queue

    def check_free_space(self) -> None:
        """507 before an upload is written when the state directory is nearly full (readiness says so too)."""
        free = free_bytes(self.cfg.state_dir)
        if free is not None and free < self.cfg.min_free_bytes:
            raise InsufficientStorageError(
                f"the state directory has {free // 2**20} MiB free, under limits.min_free_bytes "
                f"({self.cfg.min_free_bytes // 2**20} MiB); retry once jobs have been purged"
            )

    def variants(self) -> dict[str, Any]:
        if self.registry is None:
            raise NotReadyError("the model is still loading; retry shortly")
        items = self.registry.describe()
        if self.rollout is not None:
            for item in items:
                item["slots"] = self.rollout.describe(item["name"])
        return {"active": self.registry.active, "variants": items}

    async def receive_bundle(self, name: str, chunks: BodyChunks) -> dict[str, Any]:
        """POST /v1/variants/{name}/bundles: the body (an .ekb) written beside the variant's slots, bounded by
        [rollout] max_bundle_bytes, then verified, staged, gated and switched to (daemon/rollout.py)."""
        import asyncio

        from .slots import SlotDir
        from .uploads import UploadTooLargeError

        registry, _ = self.serving()
        registry.check(name)
        self.check_free_space()
        limit = self.cfg.rollout.max_bundle_bytes
        path = SlotDir(self.cfg.state_dir, name).incoming()
        try:
            size = 0
            with open(path, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise UploadTooLargeError(f"the bundle is over rollout.max_bundle_bytes ({limit} bytes)")
                    f.write(chunk)
            assert self.rollout is not None
            return await asyncio.to_thread(self.rollout.install, name, path, move=True)
        finally:
            path.unlink(missing_ok=True)

    def rollback(self, name: str) -> dict[str, Any]:
        self.serving()
        assert self.rollout is not None
        return self.rollout.rollback(name, "by hand (POST /v1/variants/{name}/rollback)")

    def activate(self, name: str) -> Loaded:
        """Blocking: load and warm `name`, then route new work to it. Under a policy this pins the variant (mode
        `fixed`), or the policy would switch away at its next tick."""
        registry, _ = self.serving()
        previous = registry.active
        if self.policy is not None:
            registry.check(name)
            registry.recheck(name)  # [trust]: a switch checks the signature again, as activate does
            self.policy.configure(settings_from_json({"mode": "fixed", "fixed": name}, self.policy.settings))
            loaded = registry.get(name)
        else:
            loaded = registry.activate(name)
        self.say(self.summary(f"switched to {loaded.name}"))
        telemetry.event("edgekit.variant.switched", variant=loaded.name, previous=previous, reason="activate")
        return loaded

    def get_policy(self) -> dict[str, Any]:
        self.serving()
        if self.policy is None:
            raise PolicyNotConfiguredError("no [policy] in this daemon's config: variants switch only when told")
        return self.policy.describe()

    def put_policy(self, body: Any) -> dict[str, Any]:
        """Blocking (a switch loads the next variant): new settings over the ones in force, decided on at once."""
        self.get_policy()
        assert self.policy is not None
        self.policy.configure(settings_from_json(body, self.policy.settings))
        return self.policy.describe()

    # --- the upload routes' ways in (submit.py) --------------------------------------------------------------------
    async def report(self, form: ReportForm, *, keep_evidence: bool, stream: bool) -> Accepted:
        return await self.submissions.report(form, keep_evidence=keep_evidence, stream=stream)

    async def create_job(self, form: ReportForm, idempotency_key: str | None) -> Submitted:
        return await self.submissions.create_job(form, idempotency_key)

    # --- DICOM networking -----------------------------------------------------------------------------------------
    async def store_instances(
        self, body: BodyChunks, content_type: str | None, study_uid: str | None, complete: bool
    ) -> StoreResult:
        """STOW-RS: the body is spooled under state_dir/stow-spool (not in the inbox, whose every folder is a study)
        and its parts stored off the event loop; instances are kept even while the model loads."""
        if not self.cfg.dicom.stow:
            raise StowDisabledError("STOW-RS is off in this daemon's config (dicom.stow = false)")
        self.check_free_space()  # 507 before the body is spooled; C-STORE meets the same floor in the inbox
        spool_dir = Path(self.cfg.state_dir) / "stow-spool"
        return await self.stow.store(body, content_type, study_uid, complete, spool_dir)

    def _quarantine_job(self, job: Job) -> None:
        """A job started `max_attempts` times without finishing (each start that ended in a crash or a kill) fails
        as quarantined instead of running again: its input stays for inspection until its retention ends."""
        error = QuarantinedError(
            f"started {job.attempts} times without finishing (limits: jobs.max_attempts = {self.cfg.max_attempts}); "
            "its input is kept in the state directory for inspection"
        )
        self.store.finish(job.id, error={**error.to_json(), "status": error.http_status})
        self.metrics.quarantined.labels("job").inc()
        log.warning("job %s quarantined after %d attempts", job.id, job.attempts)

    def job_public(self, job: Job) -> dict[str, Any]:
        """A job as the API shows it, with its deliveries (if it has any)."""
        out = job.public()
        deliveries = self.deliveries.for_job(job.id)
        if deliveries:
            out["deliveries"] = [d.public() for d in deliveries]
        return out

    def list_jobs(self, state: str | None, delivery: str | None, limit: int) -> list[dict[str, Any]]:
        return [self.job_public(j) for j in self.store.list(state=state, delivery=delivery, limit=limit)]

    def retry_deliveries(self, job_id: str) -> dict[str, Any]:
        job = self.find_job(job_id)
        self.deliveries.retry_dead(job.id)
        self.delivery.refresh_gauges()
        self.delivery.wake()
        return self.job_public(job)

    def find_job(self, job_id: str) -> Job:
        job = self.store.get(job_id) if JOB_ID.match(job_id) else None
        if job is None:
            raise JobNotFoundError("no such job (it may have passed its retention)")
        return job


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _reads_studies(registry: VariantRegistry) -> bool:
    """Whether any configured variant reads studies (a policy may switch to it): a text model's does not. A bundle
    whose manifest cannot be read counts as one that does; loading it will say what is wrong."""
    for name in registry.specs:
        try:
            if not registry.is_text(name):
                return True
        except Exception:
            return True
    return False
