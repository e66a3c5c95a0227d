"""The numerical check every pass gets: the model before and after, run in ONNX Runtime on the same feeds.

Why ORT rather than the onnx reference evaluator: it is what the `cpu` target runs, it executes contrib ops
(`MatMulNBits`), and it is fast enough to check every pass of a recipe on every build.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from .base import OutputError, initializer_bytes

# Protobuf cannot serialize a model past 2 GB; above this the check goes through a file with external data.
IN_MEMORY_LIMIT_BYTES = 1_500_000_000

ModelRef = ir.Model | bytes | str | Path  # in memory, serialized, or a saved .onnx (external data beside it)


def _serialize(model: ir.Model) -> bytes:
    """Model bytes ORT can load from memory: weights still memory-mapped from a file (a big graph after a pass
    shrank it) are read in first, since bytes cannot point at external data (this small model keeps them)."""
    ir.external_data.load_to_model(model)
    return ir.to_proto(model).SerializeToString()


def snapshot(model: ir.Model, workdir: str | Path, name: str = "model.onnx") -> bytes | Path:
    """A frozen copy of `model` for a later comparison: serialized bytes when small, else saved under `workdir`
    with its weights as external data (streamed tensor by tensor, so no 2 GB limit and no second copy in RAM)."""
    if initializer_bytes(model) <= IN_MEMORY_LIMIT_BYTES:
        return _serialize(model)
    path = Path(workdir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, path, external_data=path.name + ".data")
    return path


def session(model: ModelRef, *, optimize: bool = True, threads: int | None = None) -> ort.InferenceSession:
    """An ORT CPU session from memory, or from a file when the model is a path or too big to serialize."""
    keep = None
    data: str | bytes  # a file's path, or the serialized model
    if isinstance(model, (str, Path)):
        data = str(model)
    elif isinstance(model, bytes):
        data = model
    elif initializer_bytes(model) <= IN_MEMORY_LIMIT_BYTES:
        data = _serialize(model)
    else:
        keep = tempfile.TemporaryDirectory(prefix="edgekit-check-")
        data = str(snapshot(model, keep.name))
    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    if keep is not None:
        sess._edgekit_tmp = keep  # the temp files live as long as the session
    return sess


def run_all(sess: ort.InferenceSession, feeds: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return [dict(zip(names, sess.run(names, {k: v for k, v in f.items() if k in wanted}))) for f in feeds]


def compare_outputs(
    before: Sequence[dict[str, np.ndarray]],
    after: Sequence[dict[str, np.ndarray]],
    outputs: Sequence[str] | None = None,
) -> list[OutputError]:
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
        errors.append(
            OutputError(
                name=name,
                max_abs=float(diff.max()),
                mean_abs=float(diff.mean()),
                rel_l2=float(np.linalg.norm(got - ref) / ref_norm) if ref_norm else float(diff.max()),
                max_rel=float(diff.max() / ref_max) if ref_max else float(diff.max()),
            )
        )
    return errors


def check_models(
    before: ModelRef, after: ModelRef, feeds: Sequence[dict[str, np.ndarray]], *, outputs: Sequence[str] | None = None
) -> list[OutputError]:
    """Run both models on `feeds` and compare (all outputs unless `outputs` names some)."""
    ref = run_all(session(before), feeds)
    got = run_all(session(after), feeds)
    return compare_outputs(ref, got, outputs)
