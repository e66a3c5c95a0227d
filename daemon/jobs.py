"""Durable jobs: SQLite in WAL mode in the state directory.

A job is committed (with its input files fsynced beside it) before the client hears 202, so `kill -9` or a power
cut loses no accepted job; on start, jobs left `running` go back to `queued` and run again. Finished jobs stay
readable for the retention period, then are deleted with their files.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .telemetry import carrier

QUEUED, RUNNING, SUCCEEDED, FAILED = "queued", "running", "succeeded", "failed"
TERMINAL = (SUCCEEDED, FAILED)
# A delivery (a finished report on its way to one destination): pending until it is sent, a dead letter after the
# configured number of failed attempts, skipped when its job failed (there is no report to send).
PENDING, DELIVERED, DEAD, SKIPPED = "pending", "delivered", "dead", "skipped"
# The same states as types (the API's query parameters): a Literal takes the values themselves, not names for them.
JobState = Literal["queued", "running", "succeeded", "failed"]
DeliveryState = Literal["pending", "delivered", "dead", "skipped"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    idempotency_key TEXT UNIQUE,
    fingerprint TEXT NOT NULL,
    state TEXT NOT NULL,
    variant TEXT,
    prompt TEXT NOT NULL,
    options TEXT NOT NULL,
    input TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    error TEXT,
    trace TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, created);
CREATE TABLE IF NOT EXISTS deliveries (
    job_id TEXT NOT NULL,
    destination TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt REAL NOT NULL,
    last_error TEXT,
    delivered REAL,
    PRIMARY KEY (job_id, destination)
);
CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries(state, next_attempt);
"""


@dataclass
class Job:
    id: str
    idempotency_key: str | None
    fingerprint: str
    state: str
    variant: str | None
    prompt: str
    options: dict[str, float | int | None]  # RequestOptions.as_dict()
    input: str  # path of the study (file or folder) inside the job's directory
    created: float
    started: float | None = None
    finished: float | None = None
    attempts: int = 0
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # the error's JSON plus its HTTP "status"
    # the trace context it was accepted in (W3C carrier as JSON, `telemetry.carrier`): made inside a request's or a
    # received study's span, a job keeps it, so its report and deliveries join that trace after a restart too
    trace: str | None = field(default_factory=carrier)

    def public(self) -> dict[str, Any]:
        """What `GET /v1/jobs/{id}` shows: no prompt (it may name the patient), no paths."""
        out: dict[str, Any] = {
            "id": self.id,
            "state": self.state,
            "variant": self.variant,
            "created": self.created,
            "started": self.started,
            "finished": self.finished,
            "attempts": self.attempts,
        }
        if self.result is not None:
            out["report"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out


class JobStore:
    """Thread-safe access to the jobs table; each call is one short transaction."""

    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir) / "jobs"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        db = Path(state_dir) / "jobs.sqlite3"
        private(db)  # SQLite gives its -wal and -shm files the database's mode
        self._db = sqlite3.connect(db, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # an acknowledged job survives a power cut, not just a crash
            self._db.executescript(_SCHEMA)
            if "trace" not in {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}:  # a database from before
                self._db.execute("ALTER TABLE jobs ADD COLUMN trace TEXT")

    def job_dir(self, job_id: str) -> Path:
        return self.dir / job_id

    def save_evidence(self, job_id: str, evidence: list[dict[str, Any]]) -> None:
        """The source headers a job's SR needs, kept private beside its input (never in the database)."""
        path = self._evidence_path(job_id)
        with open(path, "w", opener=lambda p, f: os.open(p, f, 0o600)) as out:
            out.write(json.dumps(evidence))

    def evidence(self, job_id: str) -> list[dict[str, Any]]:
        path = self._evidence_path(job_id)
        return json.loads(path.read_text()) if path.is_file() else []

    def save_sr(self, job_id: str, data: bytes) -> None:
        """The SR sent to destinations, kept so that every retry (and `GET .../sr`) gives the same instance."""
        path = self.job_dir(job_id) / "report-sr.dcm"
        tmp = path.with_suffix(".part")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o600)
        os.replace(tmp, path)

    def stored_sr(self, job_id: str) -> bytes | None:
        path = self.job_dir(job_id) / "report-sr.dcm"
        return path.read_bytes() if path.is_file() else None

    def _evidence_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "evidence.json"

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def insert(self, job: Job, deliveries: tuple[str, ...] = ()) -> Job:
        """Add a queued job, with its pending `deliveries` (destination names) in the same commit; if its
        idempotency key exists, return the existing job instead (the caller compares fingerprints)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(
                    "INSERT INTO jobs (id, idempotency_key, fingerprint, state, variant, prompt, options, input, "
                    "created, attempts, trace) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        job.id,
                        job.idempotency_key,
                        job.fingerprint,
                        QUEUED,
                        job.variant,
                        job.prompt,
                        json.dumps(job.options),
                        job.input,
                        job.created,
                        job.attempts,
                        job.trace,
                    ),
                )
                self._db.executemany(
                    "INSERT OR IGNORE INTO deliveries (job_id, destination, state, next_attempt) VALUES (?, ?, ?, ?)",
                    [(job.id, d, PENDING, job.created) for d in deliveries],
                )
                self._db.execute("COMMIT")
                return job
            except sqlite3.IntegrityError:
                self._db.execute("ROLLBACK")
                row = self._db.execute(
                    "SELECT * FROM jobs WHERE idempotency_key = ?", (job.idempotency_key,)
                ).fetchone()
                if row is None:  # a duplicate id, not a duplicate key: a bug, keep the error
                    raise
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        return _job(row)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def mark_running(self, job_id: str) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET state = ?, started = ?, attempts = attempts + 1 WHERE id = ?",
                (RUNNING, time.time(), job_id),
            )

    def finish(self, job_id: str, *, result: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> None:
        state = SUCCEEDED if error is None else FAILED
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET state = ?, finished = ?, result = ?, error = ? WHERE id = ?",
                (
                    state,
                    time.time(),
                    json.dumps(result) if result is not None else None,
                    json.dumps(error) if error is not None else None,
                    job_id,
                ),
            )

    def recover(self) -> list[Job]:
        """After a crash: jobs caught running go back to the queue; return every unfinished job, oldest first."""
        with self._lock:
            self._db.execute("UPDATE jobs SET state = ? WHERE state = ?", (QUEUED, RUNNING))
            rows = self._db.execute("SELECT * FROM jobs WHERE state = ? ORDER BY created", (QUEUED,)).fetchall()
        return [_job(r) for r in rows]

    def list(self, *, state: str | None = None, delivery: str | None = None, limit: int = 100) -> list[Job]:
        """Newest first; `state` filters on the job's state, `delivery` on any of its deliveries' (e.g. "dead")."""
        where, args = [], []
        if state is not None:
            where.append("state = ?")
            args.append(state)
        if delivery is not None:
            where.append("id IN (SELECT job_id FROM deliveries WHERE state = ?)")
            args.append(delivery)
        sql = "SELECT * FROM jobs" + (f" WHERE {' AND '.join(where)}" if where else "")
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created DESC LIMIT ?", (*args, limit)).fetchall()
        return [_job(r) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {r[0]: r[1] for r in rows}

    def purge(self, retention_s: float, now: float | None = None) -> int:
        """Delete finished jobs older than the retention, with any files left in their directories."""
        cutoff = (time.time() if now is None else now) - retention_s
        with self._lock:
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT id FROM jobs WHERE state IN (?, ?) AND finished < ? AND id NOT IN "
                    "(SELECT job_id FROM deliveries WHERE state = ?)",
                    (*TERMINAL, cutoff, PENDING),
                ).fetchall()
            ]
            self._db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
            self._db.executemany("DELETE FROM deliveries WHERE job_id = ?", [(i,) for i in ids])
        for job_id in ids:
            shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        return len(ids)

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass
class Delivery:
    job_id: str
    destination: str
    state: str
    attempts: int
    next_attempt: float
    last_error: str | None
    delivered: float | None

    def public(self) -> dict[str, Any]:
        out = {"destination": self.destination, "state": self.state, "attempts": self.attempts}
        if self.state == PENDING:
            out["next_attempt"] = self.next_attempt
        if self.last_error:
            out["last_error"] = self.last_error
        if self.delivered is not None:
            out["delivered"] = self.delivered
        return out


class DeliveryStore:
    """Outbound deliveries, in the jobs database: written in the same commit that accepts a network study's job,
    so a restart at any point between receive and delivery finds each one still pending."""

    def __init__(self, jobs: JobStore):
        self._db, self._lock = jobs._db, jobs._lock

    def add(self, job_id: str, destinations: list[str], now: float | None = None) -> None:
        t = time.time() if now is None else now
        with self._lock:
            self._db.executemany(
                "INSERT OR IGNORE INTO deliveries (job_id, destination, state, next_attempt) VALUES (?, ?, ?, ?)",
                [(job_id, d, PENDING, t) for d in destinations],
            )

    def for_job(self, job_id: str) -> list[Delivery]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM deliveries WHERE job_id = ? ORDER BY destination", (job_id,)
            ).fetchall()
        return [Delivery(**dict(r)) for r in rows]

    def due(self, now: float | None = None, limit: int = 32) -> list[tuple[Delivery, str]]:
        """Pending deliveries whose time has come and whose job has finished, with the job's state."""
        t = time.time() if now is None else now
        with self._lock:
            rows = self._db.execute(
                "SELECT d.*, j.state AS job_state FROM deliveries d JOIN jobs j ON j.id = d.job_id "
                "WHERE d.state = ? AND d.next_attempt <= ? AND j.state IN (?, ?) ORDER BY d.next_attempt LIMIT ?",
                (PENDING, t, *TERMINAL, limit),
            ).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            state = d.pop("job_state")
            out.append((Delivery(**d), state))
        return out

    def next_due(self) -> float | None:
        with self._lock:
            row = self._db.execute("SELECT MIN(next_attempt) FROM deliveries WHERE state = ?", (PENDING,)).fetchone()
        return row[0] if row else None

    def delivered(self, d: Delivery) -> None:
        self._set(d, DELIVERED, d.attempts + 1, d.next_attempt, None, time.time())

    def failed(self, d: Delivery, error: str, next_attempt: float | None) -> str:
        """One failed attempt: pending again at `next_attempt`, or a dead letter when that is None."""
        state = PENDING if next_attempt is not None else DEAD
        self._set(d, state, d.attempts + 1, next_attempt or d.next_attempt, error[:500], None)
        return state

    def skip(self, d: Delivery, reason: str) -> None:
        self._set(d, SKIPPED, d.attempts, d.next_attempt, reason[:500], None)

    def retry_dead(self, job_id: str) -> int:
        """Dead letters of a job pending again (an operator fixed the destination)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE deliveries SET state = ?, attempts = 0, next_attempt = ? WHERE job_id = ? AND state = ?",
                (PENDING, time.time(), job_id, DEAD),
            )
        return cur.rowcount

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM deliveries GROUP BY state").fetchall()
        return {r[0]: r[1] for r in rows}

    def _set(self, d: Delivery, state: str, attempts: int, next_attempt: float, error, delivered) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE deliveries SET state = ?, attempts = ?, next_attempt = ?, last_error = ?, delivered = ? "
                "WHERE job_id = ? AND destination = ?",
                (state, attempts, next_attempt, error, delivered, d.job_id, d.destination),
            )


def private(path: Path) -> None:
    """Create `path` (or keep it) with mode 0600 and make sure of it: the state files hold patient headers and
    reports, whatever the state directory's mode or the process's umask (systemd's UMask=0077 is not everywhere)."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chmod(path, 0o600)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.chmod(side, 0o600)


def _job(row: sqlite3.Row) -> Job:
    d = dict(row)
    d["options"] = json.loads(d["options"])
    d["result"] = json.loads(d["result"]) if d["result"] else None
    d["error"] = json.loads(d["error"]) if d["error"] else None
    return Job(**d)
