"""edgekitd with the token engine: reports written together are the reports written alone, and a caller who
gives up frees its row (served over the Unix socket on a tiny random model)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from edgekit.daemon.client import study_files
from edgekit.daemon.testing import tiny_daemon
from edgekit.engine import Cancelled
from edgekit.generate import GenerationOptions

REPO = Path(__file__).resolve().parents[1]
STUDIES = [REPO / "models" / "samples" / name for name in ("cr_chest", "ct_chest")]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with tiny_daemon(tmp_path_factory.mktemp("batching"), "[engine]\nmax_batch = 8\n") as d:
        yield d


def _files(i: int):
    return study_files(STUDIES[i % len(STUDIES)])


def _report(d, i: int) -> dict:
    r = d.client.post_study("/v1/reports", _files(i), {"prompt": f"indication {i % 3}", "max_new_tokens": "40"})
    assert r.status == 200, r.body
    return r.json()


def test_reports_written_together_equal_reports_written_alone(daemon):
    alone = [_report(daemon, i)["text"] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = [r["text"] for r in pool.map(lambda i: _report(daemon, i), range(8))]
    assert together == alone


def test_a_sync_caller_that_times_out_frees_its_row(tmp_path):
    config = "[scheduler]\nsync_timeout_s = 0.001\n[engine]\nmax_batch = 2\n"  # every report outlives it
    with tiny_daemon(tmp_path, config) as d:
        r = d.client.post_study("/v1/reports", _files(0), {"max_new_tokens": "100"})
        assert r.status == 504 and r.json()["error"]["code"] == "timeout"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = d.client.get("/metrics").body.decode()
            if 'outcome="cancelled"' in metrics:
                break
            time.sleep(0.1)
        assert 'edgekitd_reports_total{outcome="cancelled",variant="default"} 1.0' in metrics


def test_cancel_ends_a_report_at_the_next_step(tmp_path):
    from edgekit.build import build
    from edgekit.daemon.testing import write_tiny_model
    from edgekit.reporter import Reporter

    bundle = tmp_path / "bundle"
    build("cpu", bundle, model_dir=write_tiny_model(tmp_path / "model"), parity=False)
    reporter = Reporter.from_bundle(bundle, threads=1)
    cancel = threading.Event()
    seen: list[int] = []

    def on_token(token, index):
        seen.append(token)
        if index == 2:
            cancel.set()

    with pytest.raises(Cancelled) as err:
        reporter.report(_study_path(), "x", GenerationOptions(max_new_tokens=50), on_token=on_token, cancel=cancel)
    assert err.value.code == "cancelled" and len(seen) == 3
    assert reporter.engine.in_flight == 0  # its row is free: the next report runs
    assert reporter.report(_study_path(), "x", GenerationOptions(max_new_tokens=5)).text is not None
    reporter.close()


def _study_path() -> Path:
    return STUDIES[0] / "image.dcm"
