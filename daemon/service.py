"""The service: the daemon's parts wired together, its life (start, reload, drain), and the one object routes call.

Routes parse and answer; everything a request means happens here, once for both upload routes: options checked
against the configured bound, the variant checked and pinned before the upload is read, a queue slot held while it
is read, the prompt checked against the variant's context (before and after ingest), the study ingested, and, for
a durable job, the job created under its idempotency key. Kept apart from HTTP (`api.py`, `routes.py`) and from
the process (`main.py`) so tests and the bench drive this same object.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.errors import EdgekitError, TextModelError
from edgekit.ingest.entropy import display_entropy_bits

from .config import DaemonConfig, load_config
from .delivery import DeliveryWorker
from .dicomweb import BodyChunks, StoreResult, StowService
from .dimse import StorageScp
from .forms import ReportForm
from .intake import Ingestor, Intake
from .jobs import DeliveryStore, Job, JobStore
from .metrics import Metrics
from .notify import Notifier
from .options import RequestOptions, generation_options
from .policy_loop import PolicyLoop, PolicyNotConfiguredError, capped, settings_from_json
from .queue import WorkQueue
from .received import QuarantinedError, ReceivedStudies
from .runner import ReportRunner
from .signals import SignalReader
from .streams import StreamHub, TokenStream
from .studies import StudyInbox
from .uploads import InsufficientStorageError, storage_error
from .variants import Loaded, VariantRegistry
from .work import Work

log = logging.getLogger("edgekitd")

IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")
# Tokens the modality's absence might save when the prompt is counted before ingest (with byte-level BPE it saves
# none: pre-tokenization splits at the ": "); the exact count, with the modality, follows ingest.
PROMPT_SLACK_TOKENS = 4


class NotReadyError(EdgekitError):
    code = "not_ready"
    http_status = 503


class JobNotFoundError(EdgekitError):
    code = "job_not_found"
    http_status = 404


class StowDisabledError(EdgekitError):
    code = "stow_disabled"
    http_status = 404


class IdempotencyError(EdgekitError):
    code = "invalid_idempotency_key"


class IdempotencyConflictError(EdgekitError):
    code = "idempotency_key_reused"
    http_status = 409


@dataclass
class Accepted:
    """A synchronous report in the queue; `evidence` is kept when the answer is to be an SR."""

    work: Work
    evidence: list[dict[str, Any]] | None


@dataclass
class Submitted:
    """A durable job: `created` is False when its idempotency key named an earlier, identical request."""

    job: Job
    created: bool


class Daemon:
    def __init__(self, cfg: DaemonConfig, *, notifier: Notifier | None = None, overrides: dict[str, Any] | None = None):
        self.cfg = cfg
        self.overrides: dict[str, Any] = overrides or {}
        self.notifier = notifier or Notifier()
        self.metrics = Metrics()
        Path(cfg.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.store = JobStore(cfg.state_dir)
        self.streams = StreamHub()
        self.ingestor = Ingestor(cfg, self.metrics.ingest_memory.set)
        self.registry: VariantRegistry | None = None
        self.queue: WorkQueue | None = None
        self.runner: ReportRunner | None = None
        self.policy: PolicyLoop | None = None
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
            self.received.receive,
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
            registry = self.registry = VariantRegistry(self.cfg, say=self.say, on_change=self._loaded_changed)
            self.signals = SignalReader(self.cfg, self.metrics)
            self.signals.start()
            registry.meter = self.signals.meter
            runner = self.runner = ReportRunner(registry, self.store, self.metrics, self.ingestor)
            self.queue = WorkQueue(runner, self.metrics, workers=self.cfg.workers, max_queue=self.cfg.max_queue)
            self.signals.attach(self.queue, runner)
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
                self.queue.submit(self.work_for(job, job.variant or registry.active), force=True)
                self.recovered += 1
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
        if self.policy is not None:
            threading.Thread(target=self.policy.run, args=(self._stopped,), name="edgekitd-policy", daemon=True).start()

    def _keep_alive(self, registry: VariantRegistry) -> None:
        """Unload idle variants; checks a few times per keep-alive period (at most every 5 s)."""
        while not self._stopped.wait(min(5.0, max(0.05, abs(self.cfg.keep_alive_s) / 4))):
            for name in registry.unload_idle():
                self.notifier.status(self.summary(f"unloaded idle variant {name}"))

    def _loaded_changed(self, loaded: set[str]) -> None:
        self.metrics.set_loaded(loaded, set(self.registry.specs) if self.registry else loaded)

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
        self.notifier.close()

    # --- requests -------------------------------------------------------------------------------------------------
    def serving(self) -> tuple[VariantRegistry, WorkQueue]:
        if not self.ready or self.registry is None or self.queue is None:
            raise NotReadyError("the model is still loading; retry shortly")
        return self.registry, self.queue

    def _check_free_space(self) -> None:
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
        return {"active": self.registry.active, "variants": self.registry.describe()}

    def activate(self, name: str) -> Loaded:
        """Blocking: load and warm `name`, then route new work to it. Under a policy this pins the variant (mode
        `fixed`), or the policy would switch away at its next tick."""
        registry, _ = self.serving()
        if self.policy is not None:
            registry.check(name)
            self.policy.configure(settings_from_json({"mode": "fixed", "fixed": name}, self.policy.settings))
            loaded = registry.get(name)
        else:
            loaded = registry.activate(name)
        self.say(self.summary(f"switched to {loaded.name}"))
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

    def _admit(self, form: ReportForm) -> tuple[WorkQueue, str, dict[str, int], bool]:
        """The checks both upload routes make before reading the upload; the variant the work is pinned to (a
        switch during the upload does not move it), the served point's per-report knobs, read once here (the
        upload is ingested with its frame skipping and the report written under its cap, even if a policy tick
        or the precision gate moves the variant meanwhile; `quality: "max"` asked for the best point, which
        skips no frame and caps no report), and whether the variant is a text model's: its request carries a
        prompt and no files, a VLM's its study."""
        registry, queue = self.serving()
        form.options.check(self.cfg.max_new_tokens_limit)
        chosen = form.variant
        if self.policy is not None:
            chosen = self.policy.variant_for(form.quality, form.variant)
        elif form.quality is not None:
            raise PolicyNotConfiguredError("quality needs a [policy] in the daemon's config")
        variant = registry.check(chosen or registry.active)
        text = registry.is_text(variant)
        if text:
            check_text_request(variant, form)
        else:
            form.require_files()
        self._check_prompt(variant, form, "" if text else None)  # a text prompt has no modality: counted exactly
        knobs = self.policy.knobs(variant) if self.policy is not None and form.quality != "max" else {}
        return queue, variant, knobs, text

    def precision_gate(self, variant: str, study) -> tuple[str, dict[str, Any] | None]:
        """The input-adaptive precision gate (`[precision_gate]`, off unless configured): a low-entropy study goes
        to the higher-precision variant."""
        gate = self.cfg.precision_gate
        if gate is None:
            return variant, None
        bits = display_entropy_bits(study.frames)
        routed = bits < gate.entropy_below and variant != gate.variant
        self.metrics.precision_gate.labels("higher_precision" if routed else "as_served").inc()
        chosen = self.registry.check(gate.variant) if routed else variant
        if routed:
            log.info("precision gate: study=%s entropy=%.2f bits -> %s", study.uid_hash, bits, chosen)
        info = {"entropy_bits": round(bits, 4), "entropy_below": gate.entropy_below, "routed": routed}
        return chosen, {"precision_gate": {**info, "variant": chosen}}

    async def _gate_upload(self, variant: str, study, form: ReportForm) -> tuple[str, dict[str, Any] | None]:
        """The gate for an upload, off the event loop: the histogram reads every pixel (0.3 s for a 200-slice CT
        on the dev machine), which would stall every other request and the watchdog's heartbeat. A request that
        named its variant or quality is left as asked."""
        asked = form.variant is not None or form.quality is not None
        if self.cfg.precision_gate is None or asked:
            return variant, None
        return await asyncio.to_thread(self.precision_gate, variant, study)

    def _check_prompt(self, variant: str, form: ReportForm, modality: str | None = None) -> None:
        """`prompt_too_long` (422) before the report is queued or the job stored, when the variant is loaded (else
        the report itself says so, and its job fails with the same code). Before ingest the modality is unknown:
        the prompt is counted without it, less a slack, so that a prompt that fits is never refused."""
        loaded = self.registry.peek(variant) if self.registry is not None else None
        if loaded is None:
            return
        reporter = loaded.reporter
        tokens = reporter.prompt_ids(modality or "", form.prompt).shape[1]
        if modality is None:
            tokens = max(1, tokens - PROMPT_SLACK_TOKENS)
        reporter.context.fit(tokens, generation_options(form.options, reporter.generation_config), [])

    async def report(self, form: ReportForm, *, keep_evidence: bool, stream: bool) -> Accepted:
        """Queue a synchronous report; the upload's files are gone once it is ingested (the study is in memory). A
        text model's report is queued at once: there is nothing to ingest."""
        queue, variant, knobs, text = self._admit(form)
        if text:
            if keep_evidence:
                raise TextModelError(
                    f"variant {variant!r} is a text model: its report has no source study to file an SR in"
                )
            work = Work(
                None, form.prompt, capped(form.options, knobs), variant, stream=TokenStream() if stream else None
            )
            queue.submit(work)
            return Accepted(work, None)
        queue.reserve()
        tmp = None
        intake = None
        try:
            self._check_free_space()
            tmp = Path(tempfile.mkdtemp(prefix="edgekitd-"))
            intake = await self.ingestor.take(
                form.files, tmp / "in", keep_evidence=keep_evidence, video_max_frames=knobs.get("video_max_frames")
            )
            variant, routing = await self._gate_upload(variant, intake.study, form)
            self._check_prompt(variant, form, intake.study.modality)
        except BaseException as err:
            queue.release()
            if intake is not None:
                intake.reservation.release()
            if isinstance(err, OSError):
                raise storage_error(err) from None
            raise
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        work = Work(
            study_path=intake.saved.path,
            prompt=form.prompt,
            options=capped(form.options, knobs),
            variant=variant,
            study=intake.study,
            stream=TokenStream() if stream else None,
            routing=routing,
            reservation=intake.reservation,
        )
        queue.submit(work, reserved=True)
        return Accepted(work, intake.evidence)

    async def create_job(self, form: ReportForm, idempotency_key: str | None) -> Submitted:
        """Commit a durable job (input fsynced, evidence beside it) and queue it. A key seen before answers with
        its job when the request is the same (study bytes, prompt, options, variant), else a conflict."""
        self.serving()  # "not ready" before "bad key", as before the service existed
        if idempotency_key is not None and not IDEMPOTENCY_KEY.match(idempotency_key):
            raise IdempotencyError("Idempotency-Key must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        queue, variant, knobs, text = self._admit(form)
        job_id = self.store.new_id()
        job_dir = self.store.job_dir(job_id)
        queue.reserve()
        submitted = False
        intake = None
        try:
            self._check_free_space()
            routing = None
            if not text:  # a text model's job has no input: its prompt is in the job
                intake = await self.ingestor.take(
                    form.files, job_dir / "input", keep_evidence=True, video_max_frames=knobs.get("video_max_frames")
                )
                variant, routing = await self._gate_upload(variant, intake.study, form)
                self._check_prompt(variant, form, intake.study.modality)
            job = self._new_job(job_id, form, idempotency_key, intake)
            if intake is not None:  # the headers its SR is filed under (a text model's report has no SR)
                self.store.save_evidence(job_id, intake.evidence or [])
            stored = await asyncio.to_thread(self.store.insert, job)
            if stored.id != job_id:
                if stored.fingerprint != job.fingerprint:
                    raise IdempotencyConflictError("this Idempotency-Key was used for a different request")
                return Submitted(stored, created=False)
            work = self.work_for(job, variant)
            if intake is not None:
                work.study, work.reservation = intake.study, intake.reservation
            work.routing = routing
            work.options = capped(work.options, knobs)
            queue.submit(work, reserved=True)
            submitted = True
            log.info("job %s accepted study=%s", job_id, intake.study.uid_hash if intake is not None else "-")
            return Submitted(job, created=True)
        except (OSError, sqlite3.OperationalError) as err:  # a full disk, as ENOSPC or SQLite's "disk is full"
            raise storage_error(err) from None
        finally:
            if not submitted:
                queue.release()
                if intake is not None:
                    intake.reservation.release()
                shutil.rmtree(job_dir, ignore_errors=True)

    @staticmethod
    def _new_job(job_id: str, form: ReportForm, key: str | None, intake: Intake | None) -> Job:
        """`intake` None: a text model's job, whose input is its prompt alone."""
        options = form.options.as_dict()
        digest = intake.saved.digest if intake is not None else ""
        fingerprint = hashlib.sha256(
            json.dumps([digest, form.prompt, options, form.variant], sort_keys=True).encode()
        ).hexdigest()
        return Job(
            id=job_id,
            idempotency_key=key,
            fingerprint=fingerprint,
            state="queued",
            variant=form.variant,
            prompt=form.prompt,
            options=options,
            input=str(intake.saved.path) if intake is not None else "",
            created=time.time(),
        )

    def work_for(self, job: Job, variant: str) -> Work:
        """A stored job as queue work on `variant` (the job's own, or the one active when it was accepted)."""
        return Work(
            study_path=Path(job.input) if job.input else None,
            prompt=job.prompt,
            options=RequestOptions.from_dict(job.options),
            variant=variant,
            job_id=job.id,
            cleanup=self.store.job_dir(job.id) / "input",
            stream=self.streams.open(job.id),
        )

    # --- DICOM networking -----------------------------------------------------------------------------------------
    async def store_instances(
        self, body: BodyChunks, content_type: str | None, study_uid: str | None, complete: bool
    ) -> StoreResult:
        """STOW-RS: the body is spooled under state_dir/stow-spool (not in the inbox, whose every folder is a study)
        and its parts stored off the event loop; instances are kept even while the model loads."""
        if not self.cfg.dicom.stow:
            raise StowDisabledError("STOW-RS is off in this daemon's config (dicom.stow = false)")
        self._check_free_space()  # 507 before the body is spooled; C-STORE meets the same floor in the inbox
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


def check_text_request(variant: str, form: ReportForm) -> None:
    """A text model's request is a prompt: files are refused (they would be ignored), an empty prompt too."""
    from edgekit.reporter import EmptyPromptError

    if form.files:
        raise TextModelError(
            f"variant {variant!r} is a text model (no vision graph): it writes reports from the prompt; send no files"
        )
    if not form.prompt.strip():
        raise EmptyPromptError(
            f"variant {variant!r} is a text model: it writes its report from the prompt, which is empty"
        )


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
