"""Memory: one pool for the studies the daemon holds, and the start-up check of the config against its limit.

A study's display frames stay in memory from ingest until its report is written (queued work holds them), so the
ingest budget is process-wide: every ingest tells the pool its cost (`edgekit.ingest.budget`, from headers, before
decoding) and the reservation is released when its work ends. A study that would overflow the pool is refused
with 503 and Retry-After (the queue already holds that much), one larger than the whole pool with 413 by ingest
itself. `max_queue` needs no term of its own: queued studies are in the pool.

At start the config is checked as one budget against the cgroup's memory.max (systemd's `MemoryMax=`): the pool,
one request body's part held in memory (`max_upload_bytes`: a STOW-RS instance is read whole to be checked), a
reserve for the interpreter, ONNX Runtime and the model, and one for each ingest worker process (the unit's cgroup
holds them too). A config that cannot fit does not start.
"""

from __future__ import annotations

import threading
from pathlib import Path

from edgekit.errors import ConfigError, EdgekitError
from edgekit.ingest.budget import mib

# The interpreter, numpy, ONNX Runtime with the loaded variants and the web stack, measured idle with the default
# model at about 330 MiB RSS (bench/daemon_load.py); the rest is headroom for a larger model.
RUNTIME_RESERVE = 768 * 2**20
# One ingest worker process (edgekit.ingest.workers) idle: the interpreter, numpy, pydicom and the decoders, measured
# at 70-73 MiB RSS after a JPEG 2000 study; a study's own memory is in the pool (its frames are shared, not copied).
INGEST_WORKER_RESERVE = 96 * 2**20


class IngestBusyError(EdgekitError):
    code = "ingest_busy"
    http_status = 503


class Reservation:
    """Bytes held in the pool until `release()` (idempotent: every path that ends a work item may call it)."""

    def __init__(self, pool: MemoryPool | None, nbytes: int):
        self._pool, self.nbytes = pool, nbytes

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self.nbytes)


class MemoryPool:
    """Thread-safe. `on_change(held)` reports the bytes held (a metrics gauge)."""

    def __init__(self, total: int, on_change=None):  # noqa: ANN001 - a callable of one int
        self.total, self.held = total, 0
        self._lock = threading.Lock()
        self._on_change = on_change or (lambda _held: None)

    def reserve(self, nbytes: int, *, force: bool = False) -> Reservation:
        """Hold `nbytes`, or refuse (IngestBusyError) when the pool cannot take them; `force` takes them anyway
        (a job a worker already runs: refusing it would only run it later)."""
        with self._lock:
            if not force and self.held + nbytes > self.total:
                raise IngestBusyError(
                    f"the studies in memory ({mib(self.held)} of the {mib(self.total)} ingest budget) leave no room "
                    f"for this one ({mib(nbytes)}); retry when the queue has drained"
                )
            self.held += nbytes
            held = self.held
        self._on_change(held)
        return Reservation(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
            held = self.held
        self._on_change(held)


def cgroup_memory_max(root: Path = Path("/")) -> int | None:
    """The tightest memory limit over this process's cgroup and its ancestors (v2 `memory.max`, v1
    `memory.limit_in_bytes`), in bytes; None when there is none (or no cgroup file system to read)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _id, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2
            base, name = root / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            try:
                text = (here / name).read_text().strip()
                if text.isdigit() and int(text) < 2**62:  # v1 says "no limit" with a huge number
                    limits.append(int(text))
            except OSError:
                pass
            if here == base:
                break
            here = here.parent
    return min(limits) if limits else None


def check_memory(ingest_memory_bytes: int, max_upload_bytes: int, limit: int | None, ingest_processes: int = 0) -> None:
    """Refuse a config whose budget cannot fit in `limit` (None: no limit, nothing to check), naming the numbers."""
    workers = ingest_processes * INGEST_WORKER_RESERVE
    need = ingest_memory_bytes + max_upload_bytes + RUNTIME_RESERVE + workers
    if limit is not None and need > limit:
        raise ConfigError(
            f"the config needs about {mib(need)} (limits.ingest_memory_bytes {mib(ingest_memory_bytes)} + "
            f"limits.max_upload_bytes {mib(max_upload_bytes)} + {mib(RUNTIME_RESERVE)} for the runtime and model + "
            f"{mib(workers)} for {ingest_processes} ingest process(es)) but this process's memory limit (cgroup "
            f"memory.max, systemd's MemoryMax=) is {mib(limit)}: lower those limits or raise MemoryMax="
        )
