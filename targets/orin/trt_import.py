"""Importing TensorRT and cuda-python, and what differs between TensorRT 10.x and 11.

Both exist only on the device (JetPack ships TensorRT; `pip install 'edgekit[orin]'` adds cuda-python and
Polygraphy, never TensorRT from PyPI), so every import goes through here and fails with one line that says what is
missing. The differences that matter to edgekit:
- 10.x builds weakly or strongly typed networks (`NetworkDefinitionCreationFlag.STRONGLY_TYPED`); 11 is strongly
  typed only and the flag may be gone, so it is set where it exists and required where it does not;
- DLA is not supported in TensorRT 11.0 and 11.1 (NVIDIA's "Working with DLA" page for 11.1): a DLA plan builds
  for the GPU there, and says so.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

from edgekit.errors import EdgekitError

TRT_MISSING = "TensorRT not importable (needs JetPack 6.x / TensorRT ≥ 10.3)"
CUDA_MISSING = "cuda-python not importable (pip install 'edgekit[orin]' on the Jetson)"
MIN_VERSION = (10, 3)


class DeviceRuntimeMissing(EdgekitError):
    """The device-only libraries (TensorRT, cuda-python) are not on this machine."""

    code = "device_runtime_missing"
    http_status = 503


def version_tuple(text: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(text))
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(g) for g in m.groups() if g is not None)


def check_version(version: str) -> None:
    if version_tuple(version)[:2] < MIN_VERSION:
        raise DeviceRuntimeMissing(f"TensorRT {version} is too old: {TRT_MISSING}")


def import_tensorrt() -> ModuleType:
    """The `tensorrt` module, or the one-line error. Callers that use it then `import tensorrt as trt` themselves,
    so that the type checker sees the module's own types (tensorrt-stubs) rather than a `ModuleType`."""
    try:
        import tensorrt
    except (ImportError, OSError):  # OSError: the module is there but libnvinfer is not
        raise DeviceRuntimeMissing(TRT_MISSING) from None
    version = getattr(tensorrt, "__version__", None)
    if version is None:  # not TensorRT: tensorrt-stubs' .pyi files alone import as an empty namespace package
        raise DeviceRuntimeMissing(TRT_MISSING)
    check_version(version)
    return tensorrt


def tensorrt_available() -> bool:
    try:
        import_tensorrt()
    except DeviceRuntimeMissing:
        return False
    return True


def import_cudart() -> Any:
    """cuda-python's runtime module (`cuda.bindings.runtime` from 12.6, `cuda.cudart` before). `Any`: its Cython
    extensions ship no .pyi or py.typed, so no type checker can see their signatures."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise DeviceRuntimeMissing(CUDA_MISSING) from None
    return cudart


def strongly_typed_flags() -> int:
    """Network creation flags for a strongly typed network on this TensorRT (imported by `import_tensorrt`)."""
    import tensorrt as trt

    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if flag is None:
        if version_tuple(trt.__version__)[0] < 11:
            raise DeviceRuntimeMissing(f"TensorRT {trt.__version__} has no strongly typed networks")
        return 0  # 11: every network is strongly typed
    return 1 << int(flag)


def dla_supported(version: str) -> bool:
    v = version_tuple(version)
    return not ((11, 0) <= v[:2] < (11, 2))
