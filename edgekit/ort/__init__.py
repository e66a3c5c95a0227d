"""ONNX Runtime: the reference executor (pass checks, parity, calibration) and the `cpu` target's backend."""

from .backend import CpuBackend, session_options
from .threads import physical_cores

__all__ = ["CpuBackend", "physical_cores", "session_options"]
