"""The inbox: instances received by STOW-RS or C-STORE, grouped by study and series until the study is complete.

A study is complete when no instance of it has arrived for the quiet period (modalities send a study as a burst,
often over several associations), or at once when a STOW-RS request asks. The inbox then hands the study's folder
to `complete` (the service, which makes it a durable job) and forgets it.

Everything is on disk before the sender hears success (each instance fsynced and renamed into place), under
`state_dir/inbox/<study>/<series>/<instance>.dcm` with hashed names, never UIDs or patient names. On start every
folder left there is pending again, with its quiet period restarted, so a restart between receive and report loses
nothing. A folder being handed over is first renamed into `inbox/.taken/`, and a crash during the hand-over finds
it there; the job's idempotency key (from the instances it holds) makes a second hand-over give the same job.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from edgekit.errors import EdgekitError
from edgekit.ingest.phi import hash_uid

from .instances import InstanceUids
from .uploads import fsync_dir

log = logging.getLogger("edgekitd")

TAKEN = ".taken"
ATTEMPTS = ".attempts"  # in a study's folder: how many hand-overs it has begun (a crash leaves the count behind)
RETRY_S = 1.0  # a hand-over the service refused (still loading): tried again this much later


def _count_attempt(folder: Path, step: int) -> int:
    """Add `step` to the folder's hand-over count, durably (before the ingest it guards), and return it."""
    path = folder / ATTEMPTS
    try:
        count = int(path.read_text() or 0)
    except (OSError, ValueError):
        count = 0
    count = max(0, count + step)
    tmp = folder / f"{ATTEMPTS}.part"
    with open(tmp, "w", opener=lambda p, f: os.open(p, f, 0o600)) as f:
        f.write(str(count))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
    return count


def key(uid: str) -> str:
    """A file name for a UID: stable, fixed length, not the UID."""
    return hashlib.sha256(uid.encode("utf-8")).hexdigest()[:32]


class StudyInbox:
    """Thread-safe; `add` is called from STOW-RS handlers and SCP association threads, `complete` from the
    inbox's own thread."""

    def __init__(
        self,
        root: Path,
        quiet_s: Callable[[], float],
        complete: Callable[[Path], None],
        *,
        max_attempts: Callable[[], int] = lambda: 3,
        quarantine: Callable[[Path, int], None] | None = None,
        min_free: Callable[[], int] = lambda: 0,
    ):
        self.root = Path(root)
        self.max_attempts, self.quarantine, self.min_free = max_attempts, quarantine, min_free
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.root / TAKEN).mkdir(exist_ok=True, mode=0o700)
        self.quiet_s, self.complete = quiet_s, complete
        self._lock = threading.Condition()
        self._due: dict[str, float] = {}  # study key -> monotonic time it becomes complete (0: now)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.received = 0

    # --- receiving --------------------------------------------------------------------------------------------
    def add(self, data: bytes, uids: InstanceUids) -> None:
        """Store one instance durably (the same instance again replaces it) and restart its study's quiet period.

        Below `min_free` bytes free it is refused as a full disk (ENOSPC): the sender hears Out of Resources
        (0xA700) and may retry, before the last space the jobs database needs is gone."""
        st = os.statvfs(self.root)
        if st.f_bavail * st.f_frsize - len(data) < self.min_free():
            raise OSError(errno.ENOSPC, "the state directory is under limits.min_free_bytes")
        skey = key(uids.study)
        with self._lock:
            series_dir = self.root / skey / key(uids.series)
            fresh = not series_dir.is_dir()
            series_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            final = series_dir / f"{key(uids.sop_instance)}.dcm"
            tmp = series_dir / f".{uuid.uuid4().hex}.part"
            try:
                with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:  # ENOSPC above all: nothing half-written stays behind
                tmp.unlink(missing_ok=True)
                if fresh:
                    with contextlib.suppress(OSError):
                        series_dir.rmdir()
                        series_dir.parent.rmdir()
                raise
            fsync_dir(series_dir)
            if fresh:
                fsync_dir(series_dir.parent)
                fsync_dir(self.root)
            self._due[skey] = time.monotonic() + self.quiet_s()
            self.received += 1
            self._lock.notify_all()

    def finish(self, study_uid: str) -> bool:
        """Mark a study complete now (a STOW-RS request that asks for its report at once)."""
        skey = key(study_uid)
        with self._lock:
            if skey not in self._due:
                return False
            self._due[skey] = 0.0
            self._lock.notify_all()
            return True

    def pending(self) -> int:
        with self._lock:
            return len(self._due)

    # --- life -------------------------------------------------------------------------------------------------
    def start(self) -> int:
        """Pick up what a previous run left (hand-overs first, then studies with a fresh quiet period); start the
        thread. Returns how many studies were pending."""
        now = time.monotonic()
        with self._lock:
            for d in sorted((self.root / TAKEN).iterdir()):
                if d.is_dir():
                    self._due[f"{TAKEN}/{d.name}"] = 0.0
            for d in sorted(self.root.iterdir()):
                if d.is_dir() and d.name != TAKEN:
                    self._due[d.name] = now + self.quiet_s()
            found = len(self._due)
        self._thread = threading.Thread(target=self._run, name="edgekitd-inbox", daemon=True)
        self._thread.start()
        return found

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                ready = [k for k, t in self._due.items() if t <= now]
                if not ready:
                    wait = min(self._due.values(), default=now + 1.0) - now
                    self._lock.wait(timeout=max(0.02, min(wait, 1.0)))
                    continue
                taken = []
                for skey in ready:
                    del self._due[skey]
                    taken.append((skey, self._take(skey)))
            for skey, folder in taken:
                if folder is None:
                    continue
                try:
                    self._hand_over(skey, folder)
                except Exception:  # counting the attempt failed (a full disk), or a bug: never let the thread die
                    log.exception("study %s could not be handed over; tried again shortly", hash_uid(skey))
                    with self._lock:
                        self._due[f"{TAKEN}/{folder.name}"] = time.monotonic() + RETRY_S * 10

    def _take(self, skey: str) -> Path | None:
        """Under the lock: move the study's folder out of the inbox, so later instances start a new arrival."""
        if skey.startswith(TAKEN + "/"):
            return self.root / skey
        src = self.root / skey
        if not src.is_dir():
            return None
        dest = self.root / TAKEN / f"{skey}.{uuid.uuid4().hex[:8]}"
        os.replace(src, dest)
        fsync_dir(self.root)
        return dest

    def _hand_over(self, skey: str, folder: Path) -> None:
        """Count the hand-over on disk first: one that kills the process (a study whose ingest blows the memory
        limit) is counted when the next start hands it over again, and after `max_attempts` the study is
        quarantined instead of killing every start."""
        attempts = _count_attempt(folder, +1)
        if attempts > self.max_attempts() and self.quarantine is not None:
            try:
                self.quarantine(folder, attempts - 1)
            except Exception:
                log.exception("study %s could not be quarantined; kept for the next start", hash_uid(skey))
            return
        try:
            self.complete(folder)
        except EdgekitError as err:  # not ready yet (loading, stopping, memory busy): keep it and try again
            _count_attempt(folder, -1)  # refused before it was ingested: not an attempt
            log.info("study %s waits: %s", hash_uid(skey), err.code)
            with self._lock:
                self._due[f"{TAKEN}/{folder.name}"] = time.monotonic() + RETRY_S
            return
        except Exception:  # a bug: keep the files for the next start, say so once
            log.exception("study %s could not be handed over; kept for the next start", hash_uid(skey))
            return
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)
