"""Faults: kill -9 with jobs accepted, SIGTERM with jobs queued, and overload at more than 4x capacity."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edgekit.daemon.client import study_files  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "models" / "samples"
N_JOBS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "m")


def _submit_one(d: DaemonProcess, i: int) -> str:
    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    r = d.client.post_study(
        "/v1/jobs", files, {"max_new_tokens": "120", "prompt": f"job {i}"}, headers={"Idempotency-Key": f"job-{i}"}
    )
    assert r.status == 202, r.body
    return r.json()["id"]


def _states(d: DaemonProcess, ids: list[str]) -> list[str]:
    return [d.client.get(f"/v1/jobs/{i}").json()["state"] for i in ids]


def _wait_all(d: DaemonProcess, ids: list[str], timeout: float = 90) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = _states(d, ids)
        if all(s in ("succeeded", "failed") for s in states):
            return states
        time.sleep(0.1)
    raise TimeoutError(states)


def _submit_until_some_wait(d: DaemonProcess, ids: list[str]) -> None:
    """Submit in parallel rounds until at least three jobs sit queued: a stop then finds work it must leave queued
    (one job takes tens of ms, the state read and the signal a few), whatever this machine's speed. Sequential
    submission raced the workers on a fast runner: every job finished before the stop."""
    with ThreadPoolExecutor(max_workers=N_JOBS) as pool:
        for _ in range(4):
            start = len(ids)
            ids += pool.map(lambda i: _submit_one(d, i), range(start, start + N_JOBS))
            if _states(d, ids).count("queued") >= 3:
                return
    raise AssertionError(f"no job stayed queued after {len(ids)} submissions: the test cannot prove anything")


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_every_accepted_job_completes_after_a_crash_or_stop(tmp_path, model, how):
    state = tmp_path / "state"
    # one worker: jobs submitted in parallel wait in the queue, and a stop leaves them there
    args = ["--max-queue", str(4 * N_JOBS), "--drain-timeout", "5", "--workers", "1"]
    d = DaemonProcess(state, model, extra_args=args).start()
    ids: list[str] = []
    _submit_until_some_wait(d, ids)
    if how == "kill -9":
        d.kill()
    else:
        assert d.stop() == 0
    d2 = DaemonProcess(state, model).start()
    try:
        recovered = d2.client.get("/v2/health/ready").json()["recovered_jobs"]
        assert recovered >= 1, "every job finished before the stop: the test proved nothing"
        assert _wait_all(d2, ids) == ["succeeded"] * len(ids)
        # a replayed key after the restart still finds its job
        again = d2.client.post_study(
            "/v1/jobs",
            study_files(SAMPLES / "cr_chest" / "image.dcm"),
            {"max_new_tokens": "120", "prompt": "job 0"},
            headers={"Idempotency-Key": "job-0"},
        )
        assert again.status == 200 and again.json()["id"] == ids[0]
        print(f"{how}: {len(ids)} accepted, {recovered} recovered, {len(ids)} completed")
    finally:
        d2.stop()


def test_overload_gives_only_2xx_and_503_and_stays_healthy(tmp_path, model):
    d = DaemonProcess(tmp_path / "state", model, extra_args=["--max-queue", "2", "--workers", "1"]).start()
    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    capacity = 1 + 2  # one running + two queued

    def one(_):
        r = d.client.post_study("/v1/reports", files, {"max_new_tokens": "60"})
        return r.status, r.headers.get("retry-after"), r.error_code

    try:
        with ThreadPoolExecutor(max_workers=4 * capacity + 4) as pool:
            results = list(pool.map(one, range(8 * capacity)))
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert all(ra == "5" and code == "queue_full" for s, ra, code in results if s == 503)
        ready = d.client.get("/v2/health/ready").json()
        assert ready["ready"] and ready["queue_depth"] == 0
        assert d.client.post_study("/v1/reports", files).status == 200
        assert "edgekitd_rejected_total" in d.client.get("/metrics").body.decode()
    finally:
        d.stop()
