"""Writing and validating exported graphs.

Protobuf caps a model file at 2 GB, so above a threshold (1.5 GB by default, leaving headroom) the weights go to
one `<graph>.onnx.data` file beside the graph. onnx_ir writes the numpy buffers straight out, without building a
second in-memory copy of the weights.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir

from edgekit.errors import EdgekitError

EXTERNAL_DATA_THRESHOLD_BYTES = 1_500_000_000


def initializer_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save_model(
    model: ir.Model, path: str | Path, *, external_data_threshold_bytes: int = EXTERNAL_DATA_THRESHOLD_BYTES
) -> Path:
    """Save `model`; weights go external when their total exceeds the threshold. Returns the graph's path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # a stale weights file from an earlier, larger export must not linger
    if initializer_bytes(model) > external_data_threshold_bytes:
        ir.save(model, path, external_data=data.name)
    else:
        ir.save(model, path)
    return path


def check_external_data(model: ir.Model, path: str | Path) -> None:
    """Refuse a graph whose external weights file is missing or shorter than its tensors claim, naming the file,
    before anything reads it (ORT and onnx_ir would otherwise fail late, or deep inside a pass)."""
    sizes: dict[Path, int] = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        data = Path(tensor.path)
        if data not in sizes:
            if not data.is_file():
                raise EdgekitError(
                    f"external data file {data.name} is missing (it holds this graph's weights)",
                    path,
                    code="missing_external_data",
                )
            sizes[data] = data.stat().st_size
        end = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
        if sizes[data] < end:
            raise EdgekitError(
                f"external data file {data.name} is truncated ({sizes[data]} bytes, tensor {value.name} ends at {end})",
                path,
                code="missing_external_data",
            )


def non_default_domains(model: onnx.ModelProto) -> set[str]:
    """Domains other than the default ONNX one used by any node or opset import (should be empty)."""
    domains = {op.domain for op in model.opset_import} | {n.domain for n in model.graph.node}
    return domains - {"", "ai.onnx"}


def validate(path: str | Path) -> None:
    """Full ONNX checker (strict shape inference) plus the default-domain rule. Failures here are exporter bugs."""
    path = Path(path)
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path), load_external_data=False)
    bad = non_default_domains(proto)
    if bad:
        raise AssertionError(f"{path.name} uses non-default ONNX domains {sorted(bad)}")
