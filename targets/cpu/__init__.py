"""The `cpu` target: exported ONNX graphs run in ONNX Runtime's CPU execution provider.

Build side (`build.py`): the graphs ship as the export and recipe left them, plus `decoder_cpu.onnx`, the decoder
lowered onto ORT's fused CPU kernels (`fused.py`: GroupQueryAttention over an in-place KV cache, fused norms,
packed QKV, int8-activation MatMulNBits). Run side (`runtime.py`): `CpuSlotBackend` (`slots.py`) over that
decoder, with the engine's rows bound into preallocated KV buffers; bundles without it keep
`edgekit.ort.CpuBackend` over the portable decoder.

The plug-in itself imports nothing heavy: `edgekit pareto` and the weight-format registry read every target's
declarations, and ONNX Runtime (`edgekit.ort`, re-exported below) loads only when a backend is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgekit.target import ParetoKnob

if TYPE_CHECKING:  # the type checker sees the re-exports; at run time `__getattr__` loads them on first use
    from edgekit.ort import CpuBackend, physical_cores, session_options

_FROM_ORT = ("CpuBackend", "physical_cores", "session_options")  # re-exported from edgekit.ort on first use


def __getattr__(name: str) -> Any:
    if name in _FROM_ORT:
        import edgekit.ort

        return getattr(edgekit.ort, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CpuTarget:
    name = "cpu"
    takes_machine = False
    # ONNX Runtime reads every format below; a pass naming none takes the first it can write: ORT's dynamic INT8
    # (int8), MatMulNBits (int4), GatherBlockQuantized (a 4-bit qembed), blocked DequantizeLinear (an 8-bit one)
    weight_formats = ("ort-dynamic", "matmulnbits", "gather-block-quantized", "qdq-blocked")
    # its latency is this machine's clock: threads change it; eight reports in flight share the host's steps
    pareto_knobs = {"threads": ParetoKnob(grid=(1,)), "max_batch": ParetoKnob(grid=(8,))}
    engines = ("onnxruntime",)

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """ONNX Runtime runs every recipe's graphs."""

    def prepare(self, inputs):
        from .build import prepare

        return prepare(inputs)

    def load_backend(self, bundle, options):
        from .runtime import load_backend

        return load_backend(bundle, options)


TARGET = CpuTarget()

__all__ = ["TARGET", "CpuBackend", "physical_cores", "session_options"]
