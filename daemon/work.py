"""`Work`: one report on its way from a route (or a recovered job) through the queue to a model worker."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .options import RequestOptions

if TYPE_CHECKING:
    from edgekit.ingest import Study
    from edgekit.reporter import FittedPrompt

    from .memory import Reservation
    from .streams import TokenStream


@dataclass(frozen=True)
class FittedFor:
    """A prompt tokenised and fitted by one loaded variant's reporter when the request was admitted; the report
    reuses it only on that same reporter (a reload may bring another tokenizer or context)."""

    reporter: Any
    prompt: FittedPrompt


@dataclass
class Work:
    """`job_id` set: a durable job (its state lives in the store); else a synchronous request.

    `study` is the already-ingested study when a route validated the upload up front; a job recovered after a
    restart has only `study_path` and is ingested when it runs. A text model's work has neither (`study_path`
    None): its report is written from the prompt. `variant` is pinned by the service before the work
    is queued, so a later switch does not move accepted work.
    """

    study_path: Path | None  # a synchronous request's upload is deleted once ingested: only `study` is read then
    prompt: str
    options: RequestOptions
    variant: str
    job_id: str | None = None
    study: Study | None = None
    cleanup: Path | None = None  # removed after the work ends (a durable job's input files)
    stream: TokenStream | None = None  # fed with text deltas as the report is generated
    routing: dict[str, Any] | None = None  # why the work went to its variant, when a gate chose (report JSON)
    reservation: Reservation | None = None  # the study's bytes in the ingest pool, released when the work ends
    fitted: FittedFor | None = None  # the prompt as admitted (tokenised and fitted once); None: the report does it
    trace: str | None = None  # the trace context its spans join (telemetry.carrier(): a job's is kept with it)
    future: cf.Future[dict[str, Any]] = field(default_factory=cf.Future)
    cancel: threading.Event = field(default_factory=threading.Event)  # a synchronous caller gave up: stop decoding
    accepted: float = field(default_factory=time.perf_counter)
