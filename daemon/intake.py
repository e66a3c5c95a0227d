"""Intake: an upload becomes a study once, here, for every route and for jobs recovered after a restart.

Ingest (pydicom, PyAV, the JPEG 2000 decoders) holds the GIL: it runs in worker processes
(`edgekit.ingest.workers`, `[scheduler] ingest_processes`), which the daemon's ingest threads wait on, so decoding
takes no time from the HTTP stack or the token engine's step loop (measured: c=8 went from 32 to 43 req/s on the
default model). With `ingest_processes = 0` it runs on those threads, in the daemon.
Errors about a stored file are renamed to the client's own file name, which only that client hears.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit.errors import EdgekitError
from edgekit.ingest.workers import IngestWorkers

from .config import DaemonConfig
from .memory import MemoryPool, Reservation
from .sr import collect_evidence
from .uploads import SavedStudy, save_uploads

if TYPE_CHECKING:
    from starlette.datastructures import UploadFile

    from edgekit.ingest import IngestLimits, Study


@dataclass
class Intake:
    """What one upload became: its files on disk, the study, its bytes in the memory pool, and (for SR output) the
    source headers."""

    saved: SavedStudy
    study: Study
    reservation: Reservation
    evidence: list[dict[str, Any]] | None


class Ingestor:
    """Owns the ingest threads, the memory pool and the limits from the config (reloaded with it; the pool keeps
    the size it started with)."""

    def __init__(self, cfg: DaemonConfig, on_memory=None, on_wait=None):  # noqa: ANN001 - callables of one number
        self.cfg = cfg
        self.on_wait = on_wait  # seconds a decoded study waited for an ingest thread and process (a histogram's)
        self.memory = MemoryPool(cfg.ingest_memory_bytes, on_memory)
        self._pool = ThreadPoolExecutor(max_workers=max(1, cfg.workers), thread_name_prefix="edgekitd-ingest")
        processes = ingest_processes(cfg)
        self.workers = IngestWorkers(processes, cfg.ingest_timeout_s) if processes else None

    def configure(self, cfg: DaemonConfig) -> None:
        """A reload: new limits apply to the next upload (the pools keep their sizes)."""
        self.cfg = cfg
        if self.workers is not None:
            self.workers.timeout_s = cfg.ingest_timeout_s

    def limits(self, video_max_frames: int | None = None) -> IngestLimits:
        """The config's limits; `video_max_frames` (the served point's frame skipping) lowers the config's, never
        raises it."""
        from edgekit.ingest import IngestLimits

        c = self.cfg
        return IngestLimits(
            max_files=c.max_files,
            max_frames=c.max_frames,
            max_pixels=c.max_pixels,
            max_bytes=max(c.max_upload_bytes, 1) * 8,
            video_max_frames=min(c.video_max_frames, video_max_frames or c.video_max_frames),
            memory_bytes=min(c.ingest_memory_bytes, self.memory.total),
            video_max_source_frames=c.video_max_source_frames,
            video_decode_s=c.video_decode_timeout_s,
        )

    def load(
        self, path: Path, video_max_frames: int | None = None, *, force: bool = False, waited_s: float = 0.0
    ) -> tuple[Study, Reservation]:
        """Blocking: the one ingest call (a recovered job's worker calls it directly, with the config's limits: the
        point that served when the job was accepted is not stored with it). The study's cost is reserved in the
        pool before it decodes; the caller releases the reservation when the study's work ends. `force`: a worker
        running the job now, which the pool never refuses. `waited_s`: how long the study already waited for this
        call (an ingest thread), counted in its `ingest_wait_ms` with the wait for an ingest process."""
        from edgekit.ingest import load_study

        held: list[Reservation] = []
        limits = self.limits(video_max_frames)
        admit = lambda cost: held.append(self.memory.reserve(cost, force=force))  # noqa: E731 - one line
        try:
            if self.workers is not None:
                study = self.workers.load(path, limits, admit)
            else:
                study = load_study(path, limits=limits, admit=admit)
        except BaseException:
            for reservation in held:
                reservation.release()
            raise
        study.ingest_wait_ms = (study.ingest_wait_ms or 0.0) + waited_s * 1e3
        if self.on_wait is not None:
            self.on_wait(study.ingest_wait_ms / 1e3)
        return study, held[0]

    async def take(
        self, files: Sequence[UploadFile], dest: Path, *, keep_evidence: bool, video_max_frames: int | None = None
    ) -> Intake:
        """Save the upload under `dest` and ingest it; `keep_evidence` also reads the headers an SR needs and
        makes the files durable (a job's input must outlive a power cut). `video_max_frames`: frames sampled per
        video clip when the policy skips frames (None: the config's)."""
        saved = await save_uploads(files, dest, self.cfg.max_upload_bytes, durable=keep_evidence)
        loop = asyncio.get_running_loop()
        try:
            queued = time.perf_counter()  # an ingest thread may not be free: that wait is the study's too

            def load() -> tuple[Study, Reservation]:
                return self.load(saved.path, video_max_frames, waited_s=time.perf_counter() - queued)

            study, reservation = await loop.run_in_executor(self._pool, load)
        except EdgekitError as err:
            saved.name_for_client(err)
            raise
        try:
            evidence = await loop.run_in_executor(self._pool, collect_evidence, saved.path) if keep_evidence else None
        except BaseException:
            reservation.release()
            raise
        return Intake(saved, study, reservation, evidence)

    def warm(self) -> None:
        """Start the ingest processes now (the daemon's start-up), not on the first studies' time."""
        if self.workers is not None:
            self.workers.warm()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()


def ingest_processes(cfg: DaemonConfig) -> int:
    """The configured count, or `default_processes()`: half the physical cores, 2 to 4."""
    if cfg.ingest_processes is not None:
        return cfg.ingest_processes
    from edgekit.ingest.workers import default_processes

    return default_processes()
