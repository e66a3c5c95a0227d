"""How edgekitd runs ONNX Runtime beside its ingest processes and HTTP server: half the physical cores by default
(the configured count kept), and pool threads that stop spinning at the end of each run, which is what leaves the
CPU idle between runs for the rest of the daemon."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import onnxruntime as ort

from edgekit.build import build
from edgekit.daemon.config import DaemonConfig, Variant
from edgekit.daemon.cpu_share import model_threads, plan
from edgekit.daemon.testing import write_tiny_model
from edgekit.daemon.variants import VariantRegistry
from edgekit.ort import physical_cores

SPIN_STOP = "session.force_spinning_stop"


IDLE_PROBE = """
import sys, time
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from edgekit.ort import session_options
w = numpy_helper.from_array(np.random.default_rng(0).random((512, 512), np.float32), "w")
graph = helper.make_graph(
    [helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 512])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 512])], [w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 9
opts = session_options(intra_op_threads=2, spin_between_runs=sys.argv[1] == "spin")
session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
x = np.ones((64, 512), np.float32)
for _ in range(20):
    session.run(None, {"x": x})
c0 = time.process_time()
time.sleep(0.2)  # nothing runs: what the process burns now is the pool's spinning
print((time.process_time() - c0) * 1e3)
"""


def _cpu_ms_idle_after_runs(spin: bool) -> float:
    """In a fresh process (nothing else's threads counted): a MatMul large enough for ONNX Runtime to split over
    its 2 threads, run 20 times, then a 200 ms pause."""
    out = subprocess.run(
        [sys.executable, "-c", IDLE_PROBE, "spin" if spin else "stop"], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def test_pool_threads_that_stop_spinning_leave_the_cpu_idle_between_runs():
    """ONNX Runtime's default burns CPU after a run for the next one (26-28 ms of a 200 ms pause on this CI's Xeon;
    how long it spins depends on the CPU's pause instruction): that is the CPU a daemon's ingest processes and HTTP
    server need. Stopped, the pause costs next to nothing."""
    stopped, spinning = _cpu_ms_idle_after_runs(spin=False), _cpu_ms_idle_after_runs(spin=True)
    assert stopped < 5.0
    assert spinning > 2 * stopped  # the default the setting exists for (a change in ONNX Runtime shows here)


def test_the_model_gets_half_the_physical_cores_unless_configured():
    assert model_threads(DaemonConfig()) == max(1, physical_cores() // 2)
    assert model_threads(DaemonConfig(threads=3)) == 3
    line = plan(DaemonConfig(threads=3, ort_spinning=True), 2)
    assert "ONNX Runtime threads per variant: 3 (set in the config), spinning between runs; ingest processes: 2" in line


def _stops_spinning(session: ort.InferenceSession) -> bool:
    try:
        return session.get_session_options().get_session_config_entry(SPIN_STOP) == "1"
    except RuntimeError:  # not set: ONNX Runtime's default, spinning
        return False


def test_edgekitd_sessions_stop_spinning_unless_configured(tmp_path):
    """Both cpu run sides (the fused decoder, and the portable one older bundles use) get the daemon's setting."""
    bundle = build("cpu", tmp_path / "cpu", model_dir=write_tiny_model(tmp_path / "m"), parity=False).bundle
    variants = (Variant("fused", bundle), Variant("portable", bundle, {"decoder": "portable"}))
    for spinning in (False, True):
        cfg = DaemonConfig(state_dir=tmp_path / f"state-{spinning}", variants=variants)
        registry = VariantRegistry(replace(cfg, ort_spinning=spinning))
        for name in ("fused", "portable"):
            backend = registry.activate(name).reporter.backend
            assert backend.intra_op_threads == model_threads(cfg)
            sessions = (backend.decoder, backend.embed_session, backend.vision)
            assert [_stops_spinning(s) for s in sessions] == [not spinning] * 3, name
