"""The `orin` target: NVIDIA Jetson Orin through TensorRT (JetPack 6.x, TensorRT >= 10.3).

Build side (`build.prepare`, any machine): the recipe's graphs checked against TensorRT 10.3's operator support and
made strongly typed FP16 (INT4 weight-only as blocked DequantizeLinear where the recipe quantized), optimisation
profiles and a build plan in the manifest, reference inputs and outputs, parity measured in ONNX Runtime.
On the device: `edgekit engine build` makes and caches the engines (`engine_build`), `edgekit engine check` holds
them to ONNX Runtime (`engine_check`), and the run side (`trt_runtime.TrtBackend`) serves them to run, eval,
profile and edgekitd. Without TensorRT the run side fails with `trt_import.TRT_MISSING`; `onnx_backend.
OrinOnnxBackend` runs the same graphs in ONNX Runtime as the reference. docs/orin.md says what was verified where.
"""

from __future__ import annotations

from .trt_import import TRT_MISSING


class OrinTarget:
    name = "orin"
    takes_machine = False
    weight_encoding = "orin"  # symmetric blocked DequantizeLinear: what TensorRT 10 reads as INT4 weight-only

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """Every bundled recipe builds: its passes write the orin encoding (`weight_encoding`), the capability
        check names what TensorRT would refuse and the build fixes it or stops in one line."""

    def prepare(self, inputs):
        from .build import prepare

        return prepare(inputs)

    def load_backend(self, bundle, options):
        from .trt_runtime import TrtBackend

        return TrtBackend(bundle, overrides=dict(options.settings), profile_dir=options.profile_dir)


TARGET = OrinTarget()

__all__ = ["TARGET", "TRT_MISSING"]
