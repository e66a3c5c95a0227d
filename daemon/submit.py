"""Submissions: what the two upload routes (and received studies, and recovered jobs) make of a request, once.

Options checked against the configured bound, the variant checked and pinned before the upload is read, a queue
slot held while it is read, the study ingested, the prompt tokenised and fitted to the variant's context (the
fitted prompt travels with the work, so the report does not do it again), the precision gate, and, for a durable
job, the job created under its idempotency key. Each path builds its `Work` whole, in `work_of`.

Before ingest the modality is unknown: an upload's prompt is counted without it, less a slack, so that a prompt
which cannot fit is refused before the upload is read and one that fits never is; the exact count follows ingest.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit.errors import EdgekitError, TextModelError
from edgekit.ingest.entropy import display_entropy_bits

from .forms import ReportForm
from .intake import Intake
from .jobs import Job
from .options import RequestOptions, generation_options
from .policy_loop import PolicyNotConfiguredError, capped
from .queue import WorkQueue
from .streams import TokenStream
from .telemetry import carrier
from .uploads import storage_error
from .work import FittedFor, Work

if TYPE_CHECKING:
    from edgekit.ingest import Study

    from .memory import Reservation
    from .service import Daemon

log = logging.getLogger("edgekitd")

IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Tokens the modality's absence might save when the prompt is counted before ingest (with byte-level BPE it saves
# none: pre-tokenization splits at the ": "); the exact count, with the modality, follows ingest.
PROMPT_SLACK_TOKENS = 4


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


@dataclass
class Admission:
    """A request let in before its upload is read: the queue it waits in, the variant it is pinned to (a switch
    during the upload does not move it), the served point's per-report knobs, read once here (the upload is
    ingested with its frame skipping and the report written under its cap, even if a policy tick or the
    precision gate moves the variant meanwhile; `quality: "max"` asked for the best point, which skips no frame
    and caps no report), and whether the variant is a text model's (a prompt and no files)."""

    queue: WorkQueue
    variant: str
    knobs: dict[str, int]
    text: bool
    options: RequestOptions  # the request's, under the knobs' report-length cap


class Submissions:
    """Over the daemon's parts (registry, queue, ingestor, store, policy); routes reach it through `Daemon`."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    # --- admission ------------------------------------------------------------------------------------------------
    def admit(self, form: ReportForm) -> Admission:
        """The checks both upload routes make before reading the upload."""
        d = self.daemon
        registry, queue = d.serving()
        form.options.check(d.cfg.max_new_tokens_limit)
        chosen = form.variant
        if d.policy is not None:
            chosen = d.policy.variant_for(form.quality, form.variant)
        elif form.quality is not None:
            raise PolicyNotConfiguredError("quality needs a [policy] in the daemon's config")
        variant = registry.check(chosen or registry.active)
        text = registry.is_text(variant)
        if text:
            check_text_request(variant, form)
        else:
            form.require_files()
        knobs = d.policy.knobs(variant) if d.policy is not None and form.quality != "max" else {}
        admission = Admission(queue, variant, knobs, text, capped(form.options, knobs))
        if not text:
            self.fit_prompt(variant, form.prompt, admission.options, None)  # refused before the upload is read
        return admission

    def fit_prompt(self, variant: str, prompt: str, options: RequestOptions, modality: str | None) -> FittedFor | None:
        """`prompt_too_long` (422) before the report is queued or the job stored, when the variant is loaded (else
        the report itself says so, and its job fails with the same code). With the modality (after ingest, or a
        text model's, which has none) the fitted prompt is returned for the work to carry; without it the prompt
        is counted less a slack, and only checked."""
        loaded = self.daemon.registry.peek(variant) if self.daemon.registry is not None else None
        if loaded is None:
            return None
        reporter = loaded.reporter
        opts = generation_options(options, reporter.generation_config)
        if modality is None:
            tokens = max(1, len(reporter.prompt("", prompt).ids) - PROMPT_SLACK_TOKENS)
            reporter.context.fit(tokens, opts, [])
            return None
        return FittedFor(reporter, reporter.fit_prompt(modality, prompt, opts))

    def precision_gate(self, variant: str, study: Study) -> tuple[str, dict[str, Any] | None]:
        """The input-adaptive precision gate (`[precision_gate]`, off unless configured): a low-entropy study goes
        to the higher-precision variant."""
        d = self.daemon
        gate = d.cfg.precision_gate
        if gate is None or d.registry is None:
            return variant, None
        bits = display_entropy_bits(study.frames)
        routed = bits < gate.entropy_below and variant != gate.variant
        d.metrics.precision_gate.labels("higher_precision" if routed else "as_served").inc()
        chosen = d.registry.check(gate.variant) if routed else variant
        if routed:
            log.info("precision gate: study=%s entropy=%.2f bits -> %s", study.uid_hash, bits, chosen)
        info = {"entropy_bits": round(bits, 4), "entropy_below": gate.entropy_below, "routed": routed}
        return chosen, {"precision_gate": {**info, "variant": chosen}}

    async def _gate_upload(self, variant: str, study: Study, form: ReportForm) -> tuple[str, dict[str, Any] | None]:
        """The gate for an upload, off the event loop: the histogram reads every pixel (0.3 s for a 200-slice CT
        on the dev machine), which would stall every other request and the watchdog's heartbeat. A request that
        named its variant or quality is left as asked."""
        asked = form.variant is not None or form.quality is not None
        if self.daemon.cfg.precision_gate is None or asked:
            return variant, None
        return await asyncio.to_thread(self.precision_gate, variant, study)

    async def _ingest(self, a: Admission, form: ReportForm, dest: Path, keep_evidence: bool) -> _Ingested:
        """The upload saved and ingested, gated, and its prompt fitted with the study's modality; on an error
        the study's bytes go back to the pool (the caller releases the queue slot)."""
        intake = await self.daemon.ingestor.take(
            form.files, dest, keep_evidence=keep_evidence, video_max_frames=a.knobs.get("video_max_frames")
        )
        try:
            variant, routing = await self._gate_upload(a.variant, intake.study, form)
            fitted = self.fit_prompt(variant, form.prompt, a.options, intake.study.modality)
        except BaseException:
            intake.reservation.release()
            raise
        return _Ingested(intake, variant, routing, fitted)

    # --- the routes' two ways in ----------------------------------------------------------------------------------
    async def report(self, form: ReportForm, *, keep_evidence: bool, stream: bool) -> Accepted:
        """Queue a synchronous report; the upload's files are gone once it is ingested (the study is in memory). A
        text model's report is queued at once: there is nothing to ingest."""
        a = self.admit(form)
        tokens = TokenStream() if stream else None
        if a.text:
            if keep_evidence:
                raise TextModelError(
                    f"variant {a.variant!r} is a text model: its report has no source study to file an SR in"
                )
            fitted = self.fit_prompt(a.variant, form.prompt, a.options, "")
            work = work_of(None, form.prompt, a.options, a.variant, stream=tokens, fitted=fitted)
            a.queue.submit(work)
            return Accepted(work, None)
        a.queue.reserve()
        tmp = None
        try:
            try:
                self.daemon.check_free_space()
                tmp = Path(tempfile.mkdtemp(prefix="edgekitd-"))
                got = await self._ingest(a, form, tmp / "in", keep_evidence)
            except BaseException as err:
                a.queue.release()
                if isinstance(err, OSError):
                    raise storage_error(err) from None
                raise
            work = work_of(
                got.intake.saved.path,
                form.prompt,
                a.options,
                got.variant,
                study=got.intake.study,
                reservation=got.intake.reservation,
                routing=got.routing,
                stream=tokens,
                fitted=got.fitted,
            )
            a.queue.submit(work, reserved=True)
        finally:  # once the work is queued (its study is in memory): the upload's removal is not on its path
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return Accepted(work, got.intake.evidence)

    async def create_job(self, form: ReportForm, idempotency_key: str | None) -> Submitted:
        """Commit a durable job (input fsynced, evidence beside it) and queue it. A key seen before answers with
        its job when the request is the same (study bytes, prompt, options, variant), else a conflict."""
        d = self.daemon
        d.serving()  # "not ready" before "bad key", as before the service existed
        if idempotency_key is not None and not IDEMPOTENCY_KEY.match(idempotency_key):
            raise IdempotencyError("Idempotency-Key must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        a = self.admit(form)
        job_id = d.store.new_id()
        job_dir = d.store.job_dir(job_id)
        a.queue.reserve()
        submitted = False
        got = None
        try:
            d.check_free_space()
            if a.text:  # a text model's job has no input: its prompt is in the job
                fitted = self.fit_prompt(a.variant, form.prompt, a.options, "")
            else:
                got = await self._ingest(a, form, job_dir / "input", keep_evidence=True)
                fitted = got.fitted
            job = new_job(job_id, form, idempotency_key, got.intake if got is not None else None)
            if got is not None:  # the headers its SR is filed under (a text model's report has no SR)
                d.store.save_evidence(job_id, got.intake.evidence or [])
            stored = await asyncio.to_thread(d.store.insert, job)
            if stored.id != job_id:
                if stored.fingerprint != job.fingerprint:
                    raise IdempotencyConflictError("this Idempotency-Key was used for a different request")
                return Submitted(stored, created=False)
            work = self.work_for(
                job,
                got.variant if got is not None else a.variant,
                study=got.intake.study if got is not None else None,
                reservation=got.intake.reservation if got is not None else None,
                routing=got.routing if got is not None else None,
                knobs=a.knobs,
                fitted=fitted,
            )
            a.queue.submit(work, reserved=True)
            submitted = True
            log.info("job %s accepted study=%s", job_id, got.intake.study.uid_hash if got is not None else "-")
            return Submitted(job, created=True)
        except (OSError, sqlite3.OperationalError) as err:  # a full disk, as ENOSPC or SQLite's "disk is full"
            raise storage_error(err) from None
        finally:
            if not submitted:
                a.queue.release()
                if got is not None:
                    got.intake.reservation.release()
                shutil.rmtree(job_dir, ignore_errors=True)

    def work_for(
        self,
        job: Job,
        variant: str,
        *,
        study: Study | None = None,
        reservation: Reservation | None = None,
        routing: dict[str, Any] | None = None,
        knobs: dict[str, int] | None = None,
        fitted: FittedFor | None = None,
    ) -> Work:
        """A stored job as queue work on `variant` (the job's own, or the one active when it was accepted), whole:
        its study when already ingested (else ingested when it runs), under the served point's knobs."""
        return work_of(
            Path(job.input) if job.input else None,
            job.prompt,
            capped(RequestOptions.from_dict(job.options), knobs or {}),
            variant,
            job_id=job.id,
            cleanup=self.daemon.store.job_dir(job.id) / "input",
            stream=self.daemon.streams.open(job.id),
            study=study,
            reservation=reservation,
            routing=routing,
            fitted=fitted,
            trace=job.trace,
        )


@dataclass
class _Ingested:
    intake: Intake
    variant: str
    routing: dict[str, Any] | None
    fitted: FittedFor | None


def work_of(study_path: Path | None, prompt: str, options: RequestOptions, variant: str, **parts: Any) -> Work:
    """The one place a `Work` is made (every field it will have, at once); its trace, unless given (a job's kept
    one), is the request's it is made in."""
    parts.setdefault("trace", carrier())
    return Work(study_path=study_path, prompt=prompt, options=options, variant=variant, **parts)


def new_job(job_id: str, form: ReportForm, key: str | None, intake: Intake | None) -> Job:
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
