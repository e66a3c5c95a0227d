"""The `cpu` target: exported ONNX graphs run in ONNX Runtime's CPU execution provider.

Build side (`build.py`): the graphs ship as the export and recipe left them, plus `decoder_cpu.onnx`, the decoder
lowered onto ORT's fused CPU kernels (`fused.py`: GroupQueryAttention over an in-place KV cache, fused norms,
packed QKV, int8-activation MatMulNBits). Run side (`runtime.py`): `CpuSlotBackend` (`slots.py`) over that
decoder, with the engine's rows bound into preallocated KV buffers; bundles without it keep
`edgekit.ort.CpuBackend` over the portable decoder.
"""

from edgekit.ort import CpuBackend, physical_cores, session_options


class CpuTarget:
    name = "cpu"
    takes_machine = False
    weight_encoding = None  # ONNX Runtime reads every encoding: recipes keep their own
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
