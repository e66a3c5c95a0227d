"""Durable jobs: SQLite in WAL mode in the state directory.

A job is committed (with its input files fsynced beside it) before the client hears 202, so `kill -9` or a power
cut loses no accepted job; on start, jobs left `running` go back to `queued` and run again. Finished jobs stay
readable for the retention period, then are deleted with their files.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUEUED, RUNNING, SUCCEEDED, FAILED = "queued", "running", "succeeded", "failed"
TERMINAL = (SUCCEEDED, FAILED)

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
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, created);
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

    def public(self) -> dict[str, Any]:
        """What `GET /v1/jobs/{id}` shows: no prompt (it may name the patient), no paths."""
        out = {
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
        self._db = sqlite3.connect(Path(state_dir) / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # an acknowledged job survives a power cut, not just a crash
            self._db.executescript(_SCHEMA)

    def job_dir(self, job_id: str) -> Path:
        return self.dir / job_id

    def save_evidence(self, job_id: str, evidence: list[dict[str, Any]]) -> None:
        """The source headers a job's SR needs, kept private beside its input (never in the database)."""
        path = self._evidence_path(job_id)
        path.write_text(json.dumps(evidence))
        path.chmod(0o600)

    def evidence(self, job_id: str) -> list[dict[str, Any]]:
        path = self._evidence_path(job_id)
        return json.loads(path.read_text()) if path.is_file() else []

    def _evidence_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "evidence.json"

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def insert(self, job: Job) -> Job:
        """Add a queued job; if its idempotency key exists, return the existing job instead (the caller compares
        fingerprints)."""
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO jobs (id, idempotency_key, fingerprint, state, variant, prompt, options, input, "
                    "created, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
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
                    ),
                )
                return job
            except sqlite3.IntegrityError:
                row = self._db.execute(
                    "SELECT * FROM jobs WHERE idempotency_key = ?", (job.idempotency_key,)
                ).fetchone()
                if row is None:  # a duplicate id, not a duplicate key: a bug, keep the error
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
                    "SELECT id FROM jobs WHERE state IN (?, ?) AND finished < ?", (*TERMINAL, cutoff)
                ).fetchall()
            ]
            self._db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
        for job_id in ids:
            shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        return len(ids)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _job(row: sqlite3.Row) -> Job:
    d = dict(row)
    d["options"] = json.loads(d["options"])
    d["result"] = json.loads(d["result"]) if d["result"] else None
    d["error"] = json.loads(d["error"]) if d["error"] else None
    return Job(**d)
