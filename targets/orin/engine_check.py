"""`edgekit engine check`: the engines held to ONNX Runtime on the bundle's reference inputs (as `polygraphy run
--trt --onnxrt` does), then, with an eval split, to a quality floor: a variant serves only once it passes.

Numerics: every reference case (`reference.CASES`) through the engines, compared with the ORT outputs the build
stored, within the plan's `parity_tolerance`. Quality: finding F1 of the engines on the split must reach the
floor (`--floor`, or the plan's `quality_floor.finding_f1`) and stay within `quality_floor.max_drop` of the same
graphs in ONNX Runtime. `executor="onnxrt"` runs the ONNX Runtime side alone (the bundle against its own stored
references, and its F1 against the floor): what can be checked where there is no TensorRT.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit import names
from edgekit.errors import EdgekitError

from . import reference
from .build import REFERENCE_ROLE
from .engine_build import require_orin
from .plan import DEFAULTS

if TYPE_CHECKING:
    from .onnx_backend import OrinOnnxBackend
    from .trt_runtime import TrtBackend


class GateFailedError(EdgekitError):
    code = "parity_gate_failed"
    http_status = 409


def _engine_outputs(backend, inputs: dict[str, dict]) -> dict[str, dict]:
    """The reference cases through a `TrtBackend`: the stored KV cache is fed from the host, the new one written
    to the first batch buffer and copied back, so every output is compared."""
    out = {}
    for case, feeds in inputs.items():
        role = reference.ROLE_OF[case]
        if role != names.DECODER_ROLE:
            out[case] = backend.run(role, feeds)
            continue
        run = backend.run(role, feeds, kv_out=backend.kv.present(0))
        x, past = feeds[names.INPUTS_EMBEDS], feeds[names.past_key(0)]
        got = {names.LOGITS: run[names.LOGITS]}
        for i, (k, v) in enumerate(backend.kv.to_host(0, x.shape[0], past.shape[2] + x.shape[1])):
            got[names.present_key(i)], got[names.present_value(i)] = k, v
        out[case] = got
    return out


def check_numerics(bundle, executor: str, backend=None) -> dict:
    inputs, want = reference.load(bundle.component(REFERENCE_ROLE))
    if executor == "onnxrt":
        got = reference.run_cases(bundle.root, inputs)
        against = "ONNX Runtime (cpu) now vs the outputs stored at build time"
    else:
        got = _engine_outputs(backend, inputs)
        against = "TensorRT engines vs ONNX Runtime (cpu) outputs stored at build time"
    metrics = reference.compare(got, want)
    tolerance = bundle.manifest.runtime.get("parity_tolerance", DEFAULTS["parity_tolerance"])
    failures = reference.within(metrics, tolerance)
    return {"against": against, "cases": metrics, "tolerance": tolerance, "failures": failures}


def check_quality(bundle, backend, eval_data: Path, limit: int | None, floor: float | None, executor: str) -> dict:
    from edgekit.eval.runner import evaluate
    from edgekit.reporter import Reporter

    from .onnx_backend import OrinOnnxBackend

    plan_floor = bundle.manifest.runtime.get("quality_floor", DEFAULTS["quality_floor"])
    floor = plan_floor.get("finding_f1") if floor is None else floor
    overall = evaluate(Reporter(bundle, backend=backend), eval_data, limit=limit, include_video=False)["overall"]
    out = {"split": str(eval_data), "n": overall["n"], "finding_f1": overall["finding_f1"], "floor": floor}
    out["failures"] = []
    value = float(overall["finding_f1"]["value"])
    if floor is not None and value < floor:
        out["failures"].append(f"finding F1 {value:.3f} < floor {floor}")
    if executor != "onnxrt":
        ref = evaluate(Reporter(bundle, backend=OrinOnnxBackend(bundle)), eval_data, limit=limit, include_video=False)
        out["onnxrt_finding_f1"] = ref["overall"]["finding_f1"]
        ref_value = float(ref["overall"]["finding_f1"]["value"])
        if value < ref_value - plan_floor["max_drop"]:
            drop = plan_floor["max_drop"]
            out["failures"].append(f"finding F1 {value:.3f} is more than {drop} below ONNX Runtime's {ref_value:.3f}")
    return out


def check_bundle(
    bundle,
    *,
    executor: str = "tensorrt",
    state: str | None = None,
    eval_data: Path | None = None,
    eval_limit: int | None = None,
    floor: float | None = None,
) -> dict:
    """Both gates; `passed` is False with `failures` saying why (the caller decides how to refuse)."""
    require_orin(bundle)
    backend: OrinOnnxBackend | TrtBackend
    if executor == "onnxrt":
        from .onnx_backend import OrinOnnxBackend

        backend = OrinOnnxBackend(bundle, intra_op_threads=1)
    else:
        from .trt_runtime import TrtBackend

        backend = TrtBackend(bundle, state=state)
    result: dict[str, Any] = {
        "bundle": str(bundle.source),
        "executor": executor,
        "numerics": check_numerics(bundle, executor, backend),
    }
    failures = list(result["numerics"]["failures"])
    if eval_data is not None:
        result["quality"] = check_quality(bundle, backend, Path(eval_data), eval_limit, floor, executor)
        failures += result["quality"]["failures"]
    result["passed"] = not failures
    result["failures"] = failures
    return result
