"""ONNX Runtime: the reference executor (pass checks, parity, calibration) and the `cpu` target's backend."""

from .backend import CpuBackend, open_session, session_options
from .threads import physical_cores, serving_threads

__all__ = ["CpuBackend", "open_session", "physical_cores", "serving_threads", "session_options"]
