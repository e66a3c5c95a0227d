"""Received studies: a study the inbox holds complete (STOW-RS, C-STORE) becomes a durable job, or a quarantined one.

The DICOM side's own way into jobs, apart from the upload routes' (`service.py`): a received study is ingested in
the inbox's thread with no client to answer, its job is keyed by its instances (a second hand-over finds it), it
carries one pending delivery per destination, and a study the daemon died under `max_attempts` times becomes one
failed job instead of a crash loop. It uses the service's parts (store, ingestor, queue, policy, metrics,
delivery) through the `Daemon` it is given.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edgekit.errors import EdgekitError

from .jobs import Job
from .memory import IngestBusyError
from .options import RequestOptions
from .uploads import storage_error

if TYPE_CHECKING:
    from .service import Daemon

log = logging.getLogger("edgekitd")


class QuarantinedError(EdgekitError):
    code = "quarantined"
    http_status = 422


class ReceivedStudies:
    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    def receive(self, folder: Path) -> None:
        """The inbox's hand-over (blocking, in its thread): a complete received study becomes a durable job, with
        one pending delivery per configured destination in the same commit.

        The report is written on the study's largest series (ingest reports on one stack of images); the SR lists
        every received instance as evidence. A study ingest refuses still becomes a job, failed with the reason,
        so it is visible in `GET /v1/jobs` and not dropped silently."""
        from .sr import collect_evidence

        daemon = self.daemon

        registry, queue = daemon.serving()
        series = sorted(
            (d for d in folder.iterdir() if d.is_dir()), key=lambda d: (-sum(1 for _ in d.glob("*.dcm")), d.name)
        )
        key = _received_key(folder)
        if key is None:
            return
        dicom = daemon.cfg.dicom
        job_id = daemon.store.new_id()
        job_dir = daemon.store.job_dir(job_id)
        src = job_dir / "input"
        inserted = False
        reservation = None  # until the queued work owns it
        try:
            src.mkdir(parents=True, mode=0o700)
            for f in series[0].glob("*.dcm"):
                _link_or_copy(f, src / f.name)
            _fsync_tree(src)
            variant = registry.active
            knobs = daemon.policy.knobs(variant) if daemon.policy is not None else {}
            job = self._job(job_id, key, src)
            study = error = None
            try:
                study, reservation = daemon.ingestor.load(src)
            except IngestBusyError:  # the inbox keeps the study and hands it over again shortly
                raise
            except EdgekitError as err:
                error = err
            daemon.store.save_evidence(job_id, collect_evidence(folder))
            stored = daemon.store.insert(job, tuple(d.name for d in dicom.destinations))
            inserted = stored.id == job_id
            if not inserted:  # handed over before a crash: that job stands
                return
            if error is not None:
                daemon.store.finish(job_id, error={**error.to_json(), "status": error.http_status})
                shutil.rmtree(src, ignore_errors=True)  # as a job's input goes once it has run
                daemon.metrics.dicom_studies.labels(error.code).inc()
                log.info("received study job %s failed at ingest: %s", job_id, error.code)
                daemon.delivery.wake()
                return
            assert study is not None  # ingest gave the study, or the error handled above
            variant, routing = daemon.submissions.precision_gate(variant, study)
            work = daemon.submissions.work_for(
                job, variant, study=study, reservation=reservation, routing=routing, knobs=knobs
            )
            reservation = None  # the work's now
            work.future.add_done_callback(lambda _f: daemon.delivery.wake())
            queue.submit(work, force=True)
            daemon.metrics.dicom_studies.labels("queued").inc()
            log.info("received study job %s accepted study=%s", job_id, study.uid_hash)
        except (OSError, sqlite3.OperationalError) as err:  # a full disk: the inbox keeps the study and retries
            raise storage_error(err) from None
        finally:
            if reservation is not None:
                reservation.release()
            if not inserted:
                shutil.rmtree(job_dir, ignore_errors=True)

    def quarantine(self, folder: Path, attempts: int) -> None:
        """The inbox's word that a received study was handed over `attempts` times without finishing (the
        daemon died ingesting it): one failed job, its files moved to `state_dir/quarantine/<job id>`."""
        daemon = self.daemon
        key = _received_key(folder) or f"dicom-quarantined-{folder.name}"
        job_id = daemon.store.new_id()
        kept = Path(daemon.cfg.state_dir) / "quarantine" / job_id
        error = QuarantinedError(
            f"the received study was handed over {attempts} times without finishing (jobs.max_attempts = "
            f"{daemon.cfg.max_attempts}); its instances are kept in the state directory's quarantine/{job_id}"
        )
        stored = daemon.store.insert(self._job(job_id, key, kept, attempts))
        if stored.id != job_id:  # its job was made before the crashes: the job holds the instances
            shutil.rmtree(folder, ignore_errors=True)
            return
        kept.parent.mkdir(mode=0o700, exist_ok=True)
        os.replace(folder, kept)  # recorded first: files never move without a job that says where
        daemon.store.finish(job_id, error={**error.to_json(), "status": error.http_status})
        daemon.metrics.quarantined.labels("received_study").inc()
        daemon.metrics.dicom_studies.labels("quarantined").inc()
        log.warning("received study quarantined as job %s after %d hand-overs", stored.id, attempts)

    def _job(self, job_id: str, key: str, source: Path, attempts: int = 0) -> Job:
        """A received study's job: keyed by its instances, so a second hand-over of the same study finds it."""
        daemon = self.daemon
        return Job(
            id=job_id,
            idempotency_key=key,
            fingerprint=key,
            state="queued",
            variant=None,
            prompt=daemon.cfg.dicom.prompt,
            options=RequestOptions().as_dict(),
            input=str(source),
            created=time.time(),
            attempts=attempts,
        )


def _received_key(folder: Path) -> str | None:
    """The idempotency key of a received study: its series and instance file names (hashes of their UIDs)."""
    names = sorted(f"{d.name}/{f.name}" for d in folder.iterdir() if d.is_dir() for f in d.glob("*.dcm"))
    return "dicom-" + hashlib.sha256("\n".join(names).encode()).hexdigest()[:40] if names else None


def _link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where the state dir allows (same file system: instant), else a copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
