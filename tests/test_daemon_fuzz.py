"""Schema-driven fuzzing: schemathesis generates requests from edgekitd's own OpenAPI document for every operation
and sends them to the real app in-process (ASGI transport, a real Daemon on a tiny random model); no answer may be
a 5xx and the daemon must stay ready. Bounded: a few examples per operation, well under a minute."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

TOKEN = "fuzz-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # the in-process transport looks like TCP to the app
EXAMPLES_PER_OPERATION = 60
BUDGET_S = 60.0


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from edgekit.daemon.api import create_app
    from edgekit.daemon.config import load_config
    from edgekit.daemon.service import Daemon
    from edgekit.daemon.testing import write_tiny_model

    root = tmp_path_factory.mktemp("edgekitd-fuzz")
    empty = root / "edgekitd.toml"
    empty.write_text("")  # defaults, never the machine's /etc/edgekit
    cfg = load_config(
        empty,
        {
            "state_dir": root / "state",
            "default_model_dir": write_tiny_model(root / "model"),
            "threads": 1,
            "max_upload_bytes": 1 << 20,
            "max_queue": 8,
        },
    )
    daemon = Daemon(cfg)
    daemon.start()
    yield create_app(daemon, token=TOKEN)
    daemon.stop()


def test_no_operation_answers_5xx_to_schema_generated_requests(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures: list[str] = []
    counts: dict[str, int] = {}
    statuses: set[int] = set()
    t0 = time.monotonic()
    for op in operations:
        label = f"{op.method.upper()} {op.path}"
        counts[label] = 0

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def fuzz(case):
            response = case.call(headers=AUTH)
            counts[label] += 1  # noqa: B023 - fuzz() runs within this iteration
            statuses.add(response.status_code)
            assert response.status_code < 500, f"{label} -> {response.status_code}: {response.text[:300]}"  # noqa: B023
            ctype = (response.headers.get("content-type") or [""])[0]  # schemathesis keeps a list per header
            if response.status_code >= 400 and ctype.startswith("application/json"):
                assert "error" in response.json()  # every error in the one documented shape

        try:
            fuzz()
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0])
    took = time.monotonic() - t0
    print(
        f"schemathesis {schemathesis.__version__}: {sum(counts.values())} requests over {len(counts)} operations "
        f"in {took:.1f} s; statuses seen {sorted(statuses)}"
    )
    assert not failures, failures
    assert all(n >= 1 for n in counts.values()), counts
    assert took < BUDGET_S
    # the daemon is still healthy after the run
    client = schemathesis.openapi.from_asgi("/openapi.json", app)
    ready = client["/v2/health/ready"]["GET"].Case().call(headers=AUTH)
    assert ready.status_code == 200 and ready.json()["ready"]
