"""CI installs `edgekit[dev]`: the modules whose absence makes whole test files skip must be there, or a broken
extra would only show as skips (the traces and daemon tests import-skip without them; the Helm test fails by
itself where its wheel exists)."""

from __future__ import annotations

import importlib.util
import os

import pytest

NEEDED = [
    "fastapi",  # serve: every daemon test
    "opentelemetry.sdk.trace",  # otel: tests/test_daemon_traces.py
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    "kubernetes_validate",  # test: tests/test_helm_chart.py
]


@pytest.mark.skipif(os.environ.get("EDGEKIT_REQUIRE_NATIVE") != "1", reason="EDGEKIT_REQUIRE_NATIVE=1 (CI) not set")
def test_ci_has_the_dev_extras():
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    assert not missing, f"edgekit[dev] did not install {missing}"
