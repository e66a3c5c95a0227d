"""DIMSE in: an optional Storage SCP (pynetdicom) feeding the same inbox as STOW-RS.

It answers C-ECHO, and C-STORE for the image storage SOP classes ingest reports on (`instances.IMAGE_STORAGE`),
offered only in the transfer syntaxes this install can decode, so a modality sending another syntax has it
negotiated away (it converts, or its context is rejected) instead of a study failing later. Only the configured
calling AE titles, each from its host, get an association; anyone else is rejected (permanent, "calling AE title
not recognised"), and so is an association addressed to another AE title than this SCP's ("called AE title not
recognised": pynetdicom accepts any unless told). Every rejection is logged and counted. It binds to loopback
unless `dimse.host` says otherwise.

A dataset that cannot be decoded or lacks its identifiers is answered with a failure status (0xC000 / 0xA900);
one that cannot be stored with 0xA700. Logs name the calling AE and hashed study UIDs, never patient values.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from edgekit.errors import ConfigError
from edgekit.ingest.phi import hash_uid

from .dicom_config import DicomSettings
from .instances import (
    CANNOT_UNDERSTAND,
    IMAGE_STORAGE,
    OUT_OF_RESOURCES,
    PROCESSING_FAILURE,
    Refusal,
    decodable_transfer_syntaxes,
    parse_part,
)
from .metrics import Metrics
from .studies import StudyInbox

log = logging.getLogger("edgekitd")

VERIFICATION = "1.2.840.10008.1.1"
# A-ASSOCIATE-RJ: rejected-permanent, service-user, calling AE title not recognised (PS3.8 9.3.4)
REJECT_CALLING_AE = (0x01, 0x01, 0x03)
# ... called AE title not recognised (sent by pynetdicom: `require_called_aet`)
REJECT_CALLED_AE = (0x01, 0x01, 0x07)


class StorageScp:
    def __init__(self, settings: DicomSettings, inbox: StudyInbox, metrics: Metrics):
        self.settings, self.inbox, self.metrics = settings, inbox, metrics
        self._server: Any = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server is not None else None

    def start(self) -> None:
        """Bind and serve in pynetdicom's threads; a port in use is a config error (the daemon exits 2)."""
        try:
            from pynetdicom import AE, evt
        except ImportError:
            raise ConfigError("dimse.enabled = true needs pynetdicom: pip install 'edgekit[serve]'") from None

        # pynetdicom logs every association at INFO and whole datasets at DEBUG: patient values. Warnings only.
        logging.getLogger("pynetdicom").setLevel(logging.WARNING)
        s = self.settings
        ae = AE(ae_title=s.ae_title)
        ae.maximum_associations = s.max_associations
        ae.require_calling_aet = sorted({p.ae_title for p in s.allowed})
        ae.require_called_aet = True
        syntaxes = list(decodable_transfer_syntaxes())
        ae.add_supported_context(VERIFICATION)
        for uid in IMAGE_STORAGE:
            ae.add_supported_context(uid, syntaxes)
        handlers: list[evt.EventHandlerType] = [
            (evt.EVT_REQUESTED, self._requested),
            (evt.EVT_C_ECHO, lambda _event: 0x0000),
            (evt.EVT_C_STORE, self._store),
            (evt.EVT_REJECTED, self._rejected),
            (evt.EVT_ESTABLISHED, lambda _e: self.metrics.dicom_associations.labels("accepted").inc()),
        ]
        try:
            self._server = ae.start_server((s.scp_host, s.scp_port), block=False, evt_handlers=handlers)
        except OSError as exc:
            raise ConfigError(f"cannot bind the DICOM SCP on {s.scp_host}:{s.scp_port} ({exc.strerror})") from None
        log.info("DICOM SCP %s listening on %s:%d", s.ae_title, s.scp_host, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def _requested(self, event: Any) -> None:
        """Before negotiation: the calling AE must come from its configured host (pynetdicom checks the title)."""
        assoc = event.assoc
        calling = str(assoc.requestor.primitive.calling_ae_title or "").strip()
        address = str(assoc.requestor.address)
        if not any(p.admits(calling, address) for p in self.settings.allowed):
            log.warning("DICOM association refused: calling AE %r from %s is not allowed", _title(calling), address)
            self.metrics.dicom_associations.labels("rejected").inc()
            assoc.acse.send_reject(*REJECT_CALLING_AE)
            assoc.is_rejected = True
            assoc.kill()

    def _rejected(self, event: Any) -> None:
        """pynetdicom's own rejections (the called AE title; too many associations): logged with the calling AE and
        counted, as `_requested`'s are."""
        assoc = event.assoc
        rq, rj = assoc.requestor.primitive, assoc.acceptor.primitive
        if (rj.result, rj.result_source, rj.diagnostic) == REJECT_CALLED_AE:
            why = f"called AE {_title(rq.called_ae_title)!r} is not this SCP's"
        else:
            why = f"rejected (source {rj.result_source}, diagnostic {rj.diagnostic})"
        log.warning(
            "DICOM association refused: calling AE %r from %s: %s",
            _title(rq.calling_ae_title),
            assoc.requestor.address,
            why,
        )
        self.metrics.dicom_associations.labels("rejected").inc()

    def _store(self, event: Any) -> int:
        """One C-STORE: the dataset's bytes as received, as a Part 10 file, checked as a STOW-RS part is (the same
        failure reasons), then into the inbox; the status tells the sender how it went."""
        try:
            data = event.encoded_dataset(include_meta=True)
        except Exception as err:  # no usable meta information from the request
            log.info("C-STORE from %s: unusable request (%s)", self._calling(event), type(err).__name__)
            return self._refused(CANNOT_UNDERSTAND)
        checked = parse_part(data)
        if isinstance(checked, Refusal):
            return self._refused(checked.reason)
        _ds, uids = checked
        try:
            self.inbox.add(data, uids)
        except OSError as err:
            log.error("C-STORE: cannot store an instance (%s)", err.strerror or type(err).__name__)
            return self._refused(OUT_OF_RESOURCES)
        except Exception:
            log.exception("C-STORE: storing an instance crashed")
            return self._refused(PROCESSING_FAILURE)
        self.metrics.dicom_instances.labels("dimse", "stored").inc()
        log.debug("C-STORE from %s: study %s", self._calling(event), hash_uid(uids.study))
        return 0x0000

    def _refused(self, reason: int) -> int:
        self.metrics.dicom_instances.labels("dimse", f"{reason:#06x}").inc()
        return reason

    @staticmethod
    def _calling(event: Any) -> str:
        return _title(event.assoc.requestor.ae_title)


def _title(ae_title: object) -> str:
    """An AE title from the peer, for the log: at most the 16 characters a valid one has."""
    return str(ae_title or "").strip()[:16]
