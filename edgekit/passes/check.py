"""The numerical check every pass gets: the model before and after, run in ONNX Runtime on the same feeds.

Why ORT rather than the onnx reference evaluator: it is what the `cpu` target runs, it executes contrib ops
(`MatMulNBits`), and it is fast enough to check every pass of a recipe on every build.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from .base import OutputError


def session(model: ir.Model | bytes, *, optimize: bool = True, threads: int | None = None) -> ort.InferenceSession:
    """An ORT CPU session straight from memory (no temp file)."""
    data = model if isinstance(model, bytes) else ir.to_proto(model).SerializeToString()
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def run_all(sess: ort.InferenceSession, feeds: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return [dict(zip(names, sess.run(names, {k: v for k, v in f.items() if k in wanted}))) for f in feeds]


def compare_outputs(before: Sequence[dict[str, np.ndarray]], after: Sequence[dict[str, np.ndarray]],
                    outputs: Sequence[str] | None = None) -> list[OutputError]:
    """max/mean abs error, relative L2 error and max-relative error per output, pooled over samples."""
    names = list(outputs) if outputs is not None else list(before[0])
    errors = []
    for name in names:
        ref = np.concatenate([b[name].astype(np.float64).ravel() for b in before])
        got = np.concatenate([a[name].astype(np.float64).ravel() for a in after])
        if ref.size == 0:
            errors.append(OutputError(name, 0.0, 0.0, 0.0, 0.0))
            continue
        diff = np.abs(got - ref)
        ref_norm, ref_max = float(np.linalg.norm(ref)), float(np.abs(ref).max())
        errors.append(OutputError(
            name=name, max_abs=float(diff.max()), mean_abs=float(diff.mean()),
            rel_l2=float(np.linalg.norm(got - ref) / ref_norm) if ref_norm else float(diff.max()),
            max_rel=float(diff.max() / ref_max) if ref_max else float(diff.max()),
        ))
    return errors


def check_models(before: ir.Model | bytes, after: ir.Model | bytes, feeds: Sequence[dict[str, np.ndarray]], *,
                 outputs: Sequence[str] | None = None) -> list[OutputError]:
    """Run both models on `feeds` and compare (all outputs unless `outputs` names some)."""
    ref = run_all(session(before), feeds)
    got = run_all(session(after), feeds)
    return compare_outputs(ref, got, outputs)
