"""Results out: a finished report's SR to the configured destinations (STOW-RS or C-STORE), its JSON to a webhook.

Deliveries are rows in the jobs database, written with the job (`jobs.DeliveryStore`), so they survive restarts;
this worker only sends what is due. A failed attempt is retried after `backoff_s`, doubling up to `max_backoff_s`;
after `max_attempts` failures the delivery is a dead letter: listed by `GET /v1/jobs?delivery=dead`, counted in
the metrics, retried only when an operator asks (`POST /v1/jobs/{id}/deliveries/retry`). The job and its report
stay readable whatever happens to its deliveries.

The SR is built once per job and kept beside it, so a retry sends the same SOP instance (a PACS stores it once)
and `GET /v1/jobs/{id}/sr` serves what the PACS got. Errors kept and logged name the destination and the HTTP
status or DIMSE status, never a patient value.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from edgekit import __version__ as edgekit_version
from edgekit.errors import EdgekitError

from .dicom_config import Destination, DicomSettings, read_destination_token
from .jobs import DEAD, FAILED, Delivery, DeliveryStore, JobStore
from .metrics import Metrics
from .sr import build_sr, sr_bytes

log = logging.getLogger("edgekitd")


class DeliveryError(Exception):
    """One attempt failed; the text is safe to store and log."""


def stow(dest: Destination, data: bytes) -> None:
    """POST one instance to `{url}/studies` as multipart/related; a 200, or a 202 that lists no failure, is success."""
    boundary = uuid.uuid4().hex
    body = (
        f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode() + data + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {
        "Content-Type": f'multipart/related; type="application/dicom"; boundary={boundary}',
        "Accept": "application/dicom+json",
    }
    answer = _post(dest, dest.url.rstrip("/") + "/studies", body, headers)
    if answer is not None:
        failed = answer.get("00081198", {}).get("Value") or []  # FailedSOPSequence
        if failed:
            reason = (failed[0].get("00081197", {}).get("Value") or ["?"])[0]
            raise DeliveryError(f"the destination refused the SR (FailureReason {reason:#06x})")


def webhook(dest: Destination, payload: dict[str, Any]) -> None:
    _post(dest, dest.url, json.dumps(payload).encode(), {"Content-Type": "application/json"})


def _post(dest: Destination, url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
    token = read_destination_token(dest)
    if token:
        headers = {**headers, "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=dest.timeout_s) as resp:
            status, raw = resp.status, resp.read(1 << 20)
    except urllib.error.HTTPError as err:
        raise DeliveryError(f"HTTP {err.code} from {dest.describe()}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise DeliveryError(f"cannot reach {dest.describe()}: {type(reason).__name__} {reason}"[:300]) from None
    if status not in (200, 202, 204):
        raise DeliveryError(f"HTTP {status} from {dest.describe()}")
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def cstore(dest: Destination, data: bytes, calling_ae: str) -> None:
    """C-STORE one SR to an AE (Enhanced SR, Explicit VR Little Endian); a success or warning status is success."""
    import io

    import pydicom

    try:
        from pynetdicom import AE
    except ImportError:
        raise DeliveryError("C-STORE needs pynetdicom: pip install 'edgekit[serve]'") from None
    ds = pydicom.dcmread(io.BytesIO(data))
    ae = AE(ae_title=calling_ae)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = dest.timeout_s
    ae.add_requested_context(ds.SOPClassUID, [str(ds.file_meta.TransferSyntaxUID)])
    assoc = ae.associate(dest.host, dest.port, ae_title=dest.ae_title)
    if not assoc.is_established:
        raise DeliveryError(f"association with {dest.describe()} was rejected or failed")
    try:
        status = assoc.send_c_store(ds)
    finally:
        assoc.release()
    code = getattr(status, "Status", None)
    if code is None:
        raise DeliveryError(f"no C-STORE response from {dest.describe()}")
    if code != 0x0000 and not (0xB000 <= code <= 0xBFFF):
        raise DeliveryError(f"C-STORE status {code:#06x} from {dest.describe()}")


class DeliveryWorker:
    """One thread sending due deliveries oldest first; `wake()` when a job finishes, else it polls."""

    def __init__(
        self, store: JobStore, deliveries: DeliveryStore, settings: Callable[[], DicomSettings], metrics: Metrics
    ):
        self.store, self.deliveries, self.settings, self.metrics = store, deliveries, settings, metrics
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.calling_ae = "EDGEKIT"

    def start(self) -> None:
        self.refresh_gauges()
        self._thread = threading.Thread(target=self._run, name="edgekitd-delivery", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                due = self.deliveries.due()
                for delivery, job_state in due:
                    if self._stop.is_set():
                        return
                    self.attempt(delivery, job_state)
            except Exception:  # a bug: say so, keep the worker alive
                log.exception("delivery worker error")
                due = []
            if not due:
                self._wake.wait(self.settings().poll_s)

    def attempt(self, d: Delivery, job_state: str) -> str:
        """One attempt at one delivery; returns the delivery's new state."""
        settings = self.settings()
        dest = settings.destination(d.destination)
        if job_state == FAILED:
            self.deliveries.skip(d, "the job failed: there is no report to deliver")
            self.metrics.deliveries.labels(d.destination, "skipped").inc()
            self.refresh_gauges()
            return "skipped"
        try:
            if dest is None:
                raise DeliveryError(f"destination {d.destination!r} is no longer configured")
            self._send(dest, d.job_id)
        except (DeliveryError, EdgekitError) as err:
            text = str(err)
            wait = min(settings.max_backoff_s, settings.backoff_s * (2**d.attempts))
            last = d.attempts + 1 >= settings.max_attempts
            state = self.deliveries.failed(d, text, None if last else time.time() + wait)
            self.metrics.deliveries.labels(d.destination, "dead" if state == DEAD else "retry").inc()
            log.warning(
                "delivery of job %s to %s failed (attempt %d): %s%s",
                d.job_id,
                d.destination,
                d.attempts + 1,
                text,
                "; dead letter" if state == DEAD else f"; retry in {wait:.1f} s",
            )
            self.refresh_gauges()
            return state
        except Exception as exc:  # a bug in a sender: count it as a failed attempt, keep the traceback
            log.exception("delivery of job %s to %s crashed", d.job_id, d.destination)
            state = self.deliveries.failed(d, f"internal error ({type(exc).__name__})", time.time() + 60)
            self.refresh_gauges()
            return state
        self.deliveries.delivered(d)
        self.metrics.deliveries.labels(d.destination, "delivered").inc()
        job = self.store.get(d.job_id)
        if job is not None and job.finished:
            self.metrics.delivery_latency.observe(max(0.0, time.time() - job.finished))
        log.info("delivered job %s to %s", d.job_id, d.destination)
        self.refresh_gauges()
        return "delivered"

    def _send(self, dest: Destination, job_id: str) -> None:
        job = self.store.get(job_id)
        if job is None or job.result is None:
            raise DeliveryError("the job or its report is gone (past its retention?)")
        if dest.kind == "webhook":
            webhook(dest, self.webhook_payload(job_id))
            return
        data = self.sr_for(job_id)
        if dest.kind == "stow":
            stow(dest, data)
        else:
            cstore(dest, data, self.calling_ae)

    def sr_for(self, job_id: str) -> bytes:
        """The job's SR: the one kept beside it, else built now and kept."""
        data = self.store.stored_sr(job_id)
        if data is None:
            job = self.store.get(job_id)
            assert job is not None and job.result is not None
            ds = build_sr(job.result, self.store.evidence(job_id), algorithm_version=edgekit_version)
            data = sr_bytes(ds)
            self.store.save_sr(job_id, data)
        return data

    def webhook_payload(self, job_id: str) -> dict[str, Any]:
        """The job as `GET /v1/jobs/{id}` shows it, with the study and SR identifiers a receiver files it under."""
        import io

        import pydicom

        job = self.store.get(job_id)
        assert job is not None
        out: dict[str, Any] = {"event": "report.finished", "job": job.public()}
        try:
            ds = pydicom.dcmread(io.BytesIO(self.sr_for(job_id)), stop_before_pixels=True)
            out["study_instance_uid"] = str(ds.StudyInstanceUID)
            out["sr_sop_instance_uid"] = str(ds.SOPInstanceUID)
        except (EdgekitError, AssertionError):  # a video study has no SR: the JSON goes alone
            pass
        return out

    def refresh_gauges(self) -> None:
        counts = self.deliveries.counts()
        for state in ("pending", "delivered", "dead", "skipped"):
            self.metrics.deliveries_now.labels(state).set(counts.get(state, 0))
