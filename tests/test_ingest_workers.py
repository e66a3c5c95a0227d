"""Ingest in worker processes (edgekit.ingest.workers): the same study as in-process, bit for bit, with its warnings
and errors; the caller's budget decides before a pixel is decoded; a worker that crashes or stalls is that study's
error and is replaced; and nothing of the patient reaches the worker's log."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgekit.errors import StudyError, StudyTooLargeError
from edgekit.ingest import IngestLimits, load_study
from edgekit.ingest import workers as workers_module
from edgekit.ingest.workers import IngestCrashedError, IngestTimeoutError, IngestWorkers

from ingest_factory import PHI_NAME, cut, write_mp4, write_rle_series

SAMPLE = Path(__file__).resolve().parents[1] / "models" / "samples" / "cr_chest" / "image.dcm"


@pytest.fixture
def pool():
    p = IngestWorkers(1, timeout_s=60)
    yield p
    p.close()


def _same(a, b) -> None:
    assert a.frames.shape == b.frames.shape and a.frames.dtype == b.frames.dtype == np.float32
    assert np.array_equal(a.frames, b.frames)
    assert (a.modality, a.uid_hash, a.source, a.meta, a.warnings) == (
        b.modality,
        b.uid_hash,
        b.source,
        b.meta,
        b.warnings,
    )


def test_a_j2k_file_a_series_with_a_skipped_slice_and_a_video_match_in_process(pool, tmp_path):
    folder = tmp_path / "series"
    paths = write_rle_series(folder, 6)
    cut(paths[3])  # skipped: the frames are the leading part of the array decoded into
    clip = write_mp4(tmp_path / "clip.mp4")
    for source in (SAMPLE, folder, clip):
        got = pool.load(source, IngestLimits())
        _same(got, load_study(source))
        assert got.frames.flags.writeable and got.frames.flags.c_contiguous
    assert "InstanceNumber 4" in " ".join(pool.load(folder, IngestLimits()).warnings)
    assert len(pool.pids()) == 1  # one worker served them all


def test_errors_keep_their_class_code_reason_and_path(pool, tmp_path):
    junk = tmp_path / "notes.dcm"
    junk.write_bytes(b"not dicom at all" * 20)
    with pytest.raises(StudyError) as in_process:
        load_study(junk)
    with pytest.raises(StudyError) as in_worker:
        pool.load(junk, IngestLimits())
    assert type(in_worker.value) is type(in_process.value)
    assert in_worker.value.to_json() == in_process.value.to_json() and str(in_worker.value) == str(in_process.value)

    tiny = IngestLimits(memory_bytes=4096)  # the study's own budget, checked in the worker
    with pytest.raises(StudyTooLargeError, match="over the ingest memory budget"):
        pool.load(SAMPLE, tiny)


def test_the_callers_admit_hears_the_cost_first_and_its_refusal_is_raised_as_is(pool):
    heard: list[int] = []

    class PoolFull(Exception):
        pass

    def refuse(cost: int) -> None:
        heard.append(cost)
        raise PoolFull(f"{cost} bytes do not fit")

    with pytest.raises(PoolFull):
        pool.load(SAMPLE, IngestLimits(), refuse)
    assert heard and heard[0] > 256 * 256 * 4  # the frames and one frame's working set, from the headers
    pid = pool.pids()
    pool.load(SAMPLE, IngestLimits(), heard.append)  # the same worker goes on
    assert pool.pids() == pid and heard[1] == heard[0]


def test_a_worker_killed_while_decoding_is_that_studys_error_and_is_replaced(pool):
    pool.load(SAMPLE, IngestLimits())
    (victim,) = pool.pids()
    with pytest.raises(IngestCrashedError, match="killed by SIGKILL") as err:
        pool.load(SAMPLE, IngestLimits(), lambda cost: os.kill(victim, signal.SIGKILL))
    assert err.value.code == "ingest_crashed" and err.value.http_status == 422
    _same(pool.load(SAMPLE, IngestLimits()), load_study(SAMPLE))
    assert pool.pids() != [victim]


def test_a_worker_that_died_idle_costs_no_study_its_report(pool):
    pool.load(SAMPLE, IngestLimits())
    (victim,) = pool.pids()
    os.kill(victim, signal.SIGKILL)  # the OOM killer's pick between two studies
    while len(os.listdir(f"/proc/{victim}/task")) > 1 or _state(victim) != "Z":
        time.sleep(0.01)  # until every thread has exited: only then can the process be reaped
    _same(pool.load(SAMPLE, IngestLimits()), load_study(SAMPLE))
    assert len(pool.pids()) == 1 and pool.pids() != [victim]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]


def test_close_wakes_a_caller_waiting_for_a_worker():
    pool = IngestWorkers(1, timeout_s=60)
    pool.load(SAMPLE, IngestLimits())
    worker = pool._take()  # the only worker is busy
    outcome: list[BaseException] = []
    waiter = threading.Thread(
        target=lambda: outcome.append(pytest.raises(RuntimeError, pool.load, SAMPLE, IngestLimits()).value)
    )
    waiter.start()
    time.sleep(0.3)
    pool.close()
    waiter.join(10)
    assert not waiter.is_alive() and "closed" in str(outcome[0])
    assert worker.proc.poll() is not None


def test_a_stalled_worker_is_killed_at_the_timeout():
    pool = IngestWorkers(1, timeout_s=1.0)
    try:
        pool.load(SAMPLE, IngestLimits())
        (victim,) = pool.pids()
        with pytest.raises(IngestTimeoutError, match="longer than 1 s"):
            pool.load(SAMPLE, IngestLimits(), lambda cost: os.kill(victim, signal.SIGSTOP))
        _same(pool.load(SAMPLE, IngestLimits()), load_study(SAMPLE))
        assert pool.pids() != [victim]
        with pytest.raises(ProcessLookupError):
            os.kill(victim, 0)
    finally:
        pool.close()


def test_a_worker_that_grew_is_replaced(pool, monkeypatch):
    pool.load(SAMPLE, IngestLimits())
    (first,) = pool.pids()
    monkeypatch.setattr(workers_module, "RETIRE_GROWTH_BYTES", 0)  # any growth at all
    pool.load(SAMPLE, IngestLimits())
    assert pool.pids() == []  # retired once its study was handed over
    monkeypatch.undo()
    pool.load(SAMPLE, IngestLimits())
    assert len(pool.pids()) == 1 and pool.pids() != [first]


def test_threads_share_the_workers_and_each_gets_its_own_study(tmp_path):
    folders = []
    for k in range(4):
        write_rle_series(tmp_path / f"s{k}", 3 + k)
        folders.append(tmp_path / f"s{k}")
    expected = {f: load_study(f) for f in folders}
    pool = IngestWorkers(2, timeout_s=60)
    got: dict[Path, object] = {}
    try:
        threads = [
            threading.Thread(target=lambda f=f: got.__setitem__(f, pool.load(f, IngestLimits()))) for f in folders * 2
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(pool.pids()) <= 2
    finally:
        pool.close()
    for f in folders:
        _same(got[f], expected[f])


def test_the_workers_log_carries_no_patient_data(tmp_path, capfd):
    """A series named after the patient, one slice broken: the warning travels with the study, and what the worker
    writes to the daemon's stderr (the journal) names no one."""
    folder = tmp_path / PHI_NAME.replace("^", "_")
    paths = write_rle_series(folder, 4, name=lambda k: f"{PHI_NAME.replace('^', '_')}_{k}.dcm")
    cut(paths[1])
    pool = IngestWorkers(1, timeout_s=60)
    try:
        study = pool.load(folder, IngestLimits())
    finally:
        pool.close()
    assert study.num_frames == 3 and study.warnings
    err = capfd.readouterr().err
    for secret in (PHI_NAME, PHI_NAME.replace("^", "_"), "Secretname", str(tmp_path)):
        assert secret not in err and all(secret not in w for w in study.warnings)


def test_a_study_says_how_long_it_waited_for_a_worker(pool):
    """Two studies at once against one worker: one decodes at once, the other waits about the first's decode."""
    start = threading.Barrier(2)
    studies = []

    def load() -> None:
        start.wait()
        studies.append(pool.load(SAMPLE, IngestLimits()))

    pool.load(SAMPLE, IngestLimits())  # the worker started
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first, second = sorted(studies, key=lambda s: s.ingest_wait_ms)
    assert first.ingest_wait_ms < 0.5 * second.ingest_wait_ms
    assert second.ingest_wait_ms > 0.5 * first.ingest_ms  # it waited out (most of) the other's decode
    assert load_study(SAMPLE).ingest_wait_ms is None  # decoded by its caller: no wait to report


def test_starting_a_worker_for_a_study_is_not_a_wait():
    """The first study (or one whose worker was replaced) waits for a process to start: no busy worker held it up."""
    fresh = IngestWorkers(1, timeout_s=60)
    try:
        study = fresh.load(SAMPLE, IngestLimits())
        (worker,) = fresh._all
        assert worker.start_s > 0.02  # a Python process importing pydicom
        assert study.ingest_wait_ms < 0.25 * worker.start_s * 1e3
    finally:
        fresh.close()


def test_warm_starts_every_worker_before_any_study():
    """A server's start-up starts the processes; its first studies then neither start one nor wait."""
    pool = IngestWorkers(2, timeout_s=60)
    try:
        pool.warm()
        started = sorted(pool.pids())
        assert len(started) == 2
        first = pool.load(SAMPLE, IngestLimits())
        assert sorted(pool.pids()) == started  # no process started for it
        assert first.ingest_wait_ms < 50
        pool.warm()  # nothing left to start
        assert sorted(pool.pids()) == started
    finally:
        pool.close()
    assert pool.pids() == []


def test_a_study_that_takes_a_worker_still_warming_up_did_not_wait_for_a_busy_one():
    """edgekitd's recovered jobs are queued while its processes warm up: the start-up is not a wait."""
    pool = IngestWorkers(1, timeout_s=60)
    try:
        warming = threading.Thread(target=pool.warm)
        warming.start()
        study = pool.load(SAMPLE, IngestLimits())
        warming.join()
        (worker,) = pool._all
        assert study.ingest_wait_ms < 0.25 * worker.start_s * 1e3
    finally:
        pool.close()
