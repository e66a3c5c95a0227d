"""The `orin` target: NVIDIA Jetson Orin through TensorRT (JetPack 6.x, TensorRT >= 10.3).

Build side (`build.prepare`, any machine): the recipe's graphs checked against TensorRT 10.3's operator support and
made strongly typed FP16 (INT4 weight-only as blocked DequantizeLinear where the recipe quantized), optimisation
profiles and a build plan in the manifest, reference inputs and outputs, parity measured in ONNX Runtime.
On the device: `edgekit engine build` makes and caches the engines (`engine_build`), `edgekit engine check` holds
them to ONNX Runtime (`engine_check`), and the run side (`trt_runtime.TrtBackend`) serves them to run, eval,
profile and edgekitd, building them first where the cache has none. Without TensorRT the run side fails with
`trt_import.TRT_MISSING` and says how to run anyway; `onnx_backend.OrinOnnxBackend` runs the same graphs in ONNX
Runtime as the reference (`engine=onnxruntime`, the target's second engine: `edgekit run | eval | profile --engine
onnxruntime`), and with `estimate=DEVICE:MODE` bills each report by the Orin cost model (`run_settings`,
`estimate_billing`), so an orin bundle gives estimated Orin figures on any machine. docs/orin.md says what was
verified where.
"""

from __future__ import annotations

from edgekit.target import ParetoKnob

from .trt_import import TRT_MISSING

# what the run side's missing-TensorRT line goes on to say (the CLI shows `engine=onnxruntime` as its flag)
OFF_DEVICE_HINT = (
    "off the Jetson, run the bundle's ONNX graphs in ONNX Runtime with `engine=onnxruntime` (figures estimated by "
    "the Orin cost model, not measured)"
)


class OrinTarget:
    name = "orin"
    takes_machine = False
    weight_formats = ("qdq-blocked",)  # symmetric blocked DequantizeLinear: what TensorRT 10 reads as INT4 weight-only
    # `orin_estimate=DEVICE:MODE`: the graphs in ONNX Runtime here, each report billed by the Orin cost model; it
    # says which device bills the figures (a front of its own), not what a report costs
    pareto_knobs = {"orin_estimate": ParetoKnob(setting="estimate", fixed={"engine": "onnxruntime"}, device=True)}
    engines = ("tensorrt", "onnxruntime")  # the device's engines; the same graphs in ONNX Runtime anywhere

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """Every bundled recipe builds: its passes write the format orin takes (`weight_formats`), the capability
        check names what TensorRT would refuse and the build fixes it or stops in one line."""

    def prepare(self, inputs):
        from .build import prepare

        return prepare(inputs)

    def load_backend(self, bundle, options):
        """`engine=tensorrt` (default): this device's engines, built on first load when the cache has none (a
        service's first start; a no-op when they are current). `engine=onnxruntime`: the same graphs in ONNX
        Runtime, billed by the Orin estimate when `estimate=DEVICE:MODE` is set, or when `options.engine` asked for
        it (`run_settings`). Without TensorRT, one line naming the bundle that says how to run it anyway."""
        from .run_settings import read_settings

        run = read_settings(options.settings, bundle.source, engine=options.engine)
        if run.engine == "onnxruntime":
            from .estimate_billing import EstimateBilling
            from .onnx_backend import OrinOnnxBackend

            billing = EstimateBilling(bundle, *run.estimate) if run.estimate is not None else None
            return OrinOnnxBackend(
                bundle,
                intra_op_threads=options.threads,
                profile_dir=options.profile_dir,
                spin_between_runs=options.spin_between_runs,
                billing=billing,
                overrides=run.plan_overrides,  # max_batch only: the others are refused for onnxruntime
            )
        from .engine_build import ensure_engines
        from .trt_import import DeviceRuntimeMissing, import_tensorrt
        from .trt_runtime import TrtBackend

        try:
            import_tensorrt()  # before the bundle's graphs are read
        except DeviceRuntimeMissing as err:  # `engine=` reads as --engine on the command line
            raise DeviceRuntimeMissing(f"{err.reason}; {OFF_DEVICE_HINT}", bundle.source) from None
        state = None if options.state_dir is None else str(options.state_dir)
        ensure_engines(bundle, state=state, overrides=run.plan_overrides)
        return TrtBackend(bundle, overrides=run.plan_overrides, state=state, profile_dir=options.profile_dir)


TARGET = OrinTarget()

__all__ = ["OFF_DEVICE_HINT", "TARGET", "TRT_MISSING"]
