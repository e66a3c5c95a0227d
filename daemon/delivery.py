"""Results out: a finished report's SR to the configured destinations (STOW-RS or C-STORE), its JSON to a webhook.

Deliveries are rows in the jobs database, written with the job (`jobs.DeliveryStore`), so they survive restarts;
this worker only sends what is due. A failed attempt is retried after `backoff_s`, doubling up to `max_backoff_s`;
after `max_attempts` failures the delivery is a dead letter: listed by `GET /v1/jobs?delivery=dead`, counted in
the metrics, retried only when an operator asks (`POST /v1/jobs/{id}/deliveries/retry`). The job and its report
stay readable whatever happens to its deliveries.

The SR is built once per job and kept beside it, so a retry sends the same SOP instance (a PACS stores it once)
and `GET /v1/jobs/{id}/sr` serves what the PACS got. Errors kept and logged name the destination (as
`Destination.describe()` gives it: no user:password@, no query string) and the HTTP or DIMSE status, never a patient
value nor an exception's own text (pydicom/highdicom quote element values, httpx quotes the full URL).

HTTP goes out through httpx with redirects off: a 3xx is a failed attempt, so a POST never becomes a GET and a
bearer token never follows a `Location` to another host.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from edgekit import __version__ as edgekit_version
from edgekit.errors import EdgekitError
from edgekit.ingest.phi import phi_guard

from . import telemetry, trace_spans
from .dicom_config import Destination, DicomSettings, read_destination_token
from .jobs import DEAD, FAILED, Delivery, DeliveryStore, JobStore
from .metrics import Metrics
from .sr import render_sr

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
    answer = _post(dest, "/studies", body, headers)
    if answer is not None:
        failed = answer.get("00081198", {}).get("Value") or []  # FailedSOPSequence
        if failed:
            reason = (failed[0].get("00081197", {}).get("Value") or ["?"])[0]
            raise DeliveryError(f"the destination refused the SR (FailureReason {reason:#06x})")


def webhook(dest: Destination, payload: dict[str, Any]) -> None:
    _post(dest, "", json.dumps(payload).encode(), {"Content-Type": "application/json"})


def _post(dest: Destination, below: str, body: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
    """One POST to `below` under the URL's path (its query kept), redirects off; the answer's JSON (first MiB) on a
    200/202/204, else a DeliveryError."""
    for name in ("httpx", "httpcore"):  # at INFO and DEBUG they log each request's full URL (userinfo, query)
        logging.getLogger(name).setLevel(logging.WARNING)
    token = read_destination_token(dest)
    headers = {**headers}
    telemetry.inject(headers)  # traceparent: the receiver's spans join the study's trace
    # certificates checked against the system's CA store, where a hospital installs its own CA (as urllib did;
    # httpx's default is certifi's bundle alone)
    tls = ssl.create_default_context()
    try:
        url = httpx.URL(dest.url or "")
        url = url.copy_with(path=url.path.rstrip("/") + below) if below else url
        with (
            httpx.Client(timeout=httpx.Timeout(dest.timeout_s), verify=tls, follow_redirects=False) as client,
            client.stream("POST", url, content=body, headers=headers, auth=_bearer(token) if token else None) as resp,
        ):
            status = resp.status_code
            telemetry.set_attribute("http.response.status_code", status)
            raw = _head(resp, 1 << 20) if status in (200, 202, 204) else b""
    except httpx.TransportError as exc:
        raise DeliveryError(f"cannot reach {dest.describe()}: {type(exc).__name__}{_reason(exc)}") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise DeliveryError(f"request to {dest.describe()} failed: {type(exc).__name__}") from None
    if 300 <= status < 400:
        raise DeliveryError(f"HTTP {status} from {dest.describe()}: redirects are not followed")
    if status not in (200, 202, 204):
        raise DeliveryError(f"HTTP {status} from {dest.describe()}")
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _bearer(token: str) -> Callable[[httpx.Request], httpx.Request]:
    """The token as httpx auth: it takes precedence over a user:password@ in the URL (httpx's Basic auth)."""

    def add(request: httpx.Request) -> httpx.Request:
        request.headers["Authorization"] = f"Bearer {token}"
        return request

    return add


def _head(resp: httpx.Response, limit: int) -> bytes:
    """The first `limit` bytes of an answer, without reading the rest."""
    out = bytearray()
    for chunk in resp.iter_bytes():
        out += chunk
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _reason(exc: BaseException) -> str:
    """The OS's words for a transport failure ("Connection refused"), found down the exception chain; never the
    exception's own text, which can hold the URL."""
    link: BaseException | None = exc
    while link is not None:
        if isinstance(link, ssl.SSLError):
            return f" ({link.reason})" if isinstance(link.reason, str) else ""
        if isinstance(link, OSError):
            return f" ({link.strerror})" if isinstance(link.strerror, str) else ""
        link = link.__cause__ or link.__context__
    return ""


def cstore(dest: Destination, data: bytes, calling_ae: str) -> None:
    """C-STORE one SR to an AE (Enhanced SR, Explicit VR Little Endian); a success or warning status is success."""
    import io

    import pydicom

    try:
        from pynetdicom import AE
    except ImportError:
        raise DeliveryError("C-STORE needs pynetdicom: pip install 'edgekit[serve]'") from None
    if dest.host is None or dest.port is None or dest.ae_title is None:  # dicom_config refuses such a destination
        raise DeliveryError(f"{dest.describe()} needs ae_title, host and port")
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
    telemetry.set_attribute("edgekit.dimse.status", code)
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
        # each settled delivery (delivered, or a dead letter) by the job's variant, for the rollouts' canary windows
        self.on_outcome: Callable[[str | None, bool], None] | None = None

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
            with trace_spans.delivery_span(dest, d.job_id, d.attempts + 1, self._trace(d.job_id)):
                self._send(dest, d.job_id)
        except Exception as exc:  # every failure counts toward max_attempts, whatever raised it
            return self._failed(d, exc, settings)
        self.deliveries.delivered(d)
        self.metrics.deliveries.labels(d.destination, "delivered").inc()
        job = self.store.get(d.job_id)
        if self.on_outcome is not None:
            self.on_outcome(job.variant if job else None, True)
        if job is not None and job.finished:
            self.metrics.delivery_latency.observe(max(0.0, time.time() - job.finished))
        log.info("delivered job %s to %s", d.job_id, d.destination)
        self.refresh_gauges()
        return "delivered"

    def _failed(self, d: Delivery, exc: Exception, settings: DicomSettings) -> str:
        """Record one failed attempt: retried after the backoff, a dead letter after `max_attempts`."""
        if isinstance(exc, (DeliveryError, EdgekitError)):
            text = str(exc)
        else:  # a bug in a sender: keep where it happened, not its message (it may quote a patient value)
            text = f"internal error ({type(exc).__name__})"
            stack = "".join(traceback.format_tb(exc.__traceback__))
            log.error("delivery of job %s to %s crashed: %s\n%s", d.job_id, d.destination, text, stack.rstrip())
        wait = min(settings.max_backoff_s, settings.backoff_s * (2**d.attempts))
        last = d.attempts + 1 >= settings.max_attempts
        state = self.deliveries.failed(d, text, None if last else time.time() + wait)
        self.metrics.deliveries.labels(d.destination, "dead" if state == DEAD else "retry").inc()
        if state == DEAD and self.on_outcome is not None:
            job = self.store.get(d.job_id)
            self.on_outcome(job.variant if job else None, False)
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

    def _trace(self, job_id: str) -> str | None:
        """The trace context the job was accepted in (its deliveries join that trace)."""
        if not telemetry.enabled():
            return None
        job = self.store.get(job_id)
        return job.trace if job is not None else None

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
        """The job's SR: the one kept beside it, else built now and kept (`sr.render_sr`: a study whose headers
        highdicom refuses is an SrUnavailableError naming only the exception type, built under `phi_guard`)."""
        data = self.store.stored_sr(job_id)
        if data is None:
            job = self.store.get(job_id)
            if job is None or job.result is None:
                raise DeliveryError("the job or its report is gone (past its retention?)")
            with trace_spans.render_sr_span(job_id=job_id, variant=job.result.get("variant")):
                data = render_sr(job.result, self.store.evidence(job_id), algorithm_version=edgekit_version)
            self.store.save_sr(job_id, data)
        return data

    def webhook_payload(self, job_id: str) -> dict[str, Any]:
        """The job as `GET /v1/jobs/{id}` shows it, with the study and SR identifiers a receiver files it under;
        without them when there is no SR (a video study, headers an SR cannot be built from): a webhook needs none."""
        import io

        import pydicom

        job = self.store.get(job_id)
        if job is None:
            raise DeliveryError("the job is gone (past its retention?)")
        out: dict[str, Any] = {"event": "report.finished", "job": job.public()}
        try:
            with phi_guard():
                ds = pydicom.dcmread(io.BytesIO(self.sr_for(job_id)), stop_before_pixels=True)
                ids = {"study_instance_uid": str(ds.StudyInstanceUID), "sr_sop_instance_uid": str(ds.SOPInstanceUID)}
        except Exception:  # whatever keeps the SR from being built or read: the JSON goes alone
            ids = {}
        return {**out, **ids}

    def refresh_gauges(self) -> None:
        counts = self.deliveries.counts()
        for state in ("pending", "delivered", "dead", "skipped"):
            self.metrics.deliveries_now.labels(state).set(counts.get(state, 0))
