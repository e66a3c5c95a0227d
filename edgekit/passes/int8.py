"""INT8 dynamic quantization for `cpu`: ONNX Runtime's `quantize_dynamic` as the engine, wrapped as a pass.

Why wrap rather than reimplement: ORT's dynamic MatMulInteger/DynamicQuantizeLinear path is what its CPU kernels
are tuned for. The wrapper adds what the bare call lacks: it folds our `Transpose -> MatMul` weights first (ORT
only quantizes MatMuls whose B is an initializer), restricts itself to weight MatMuls, and gets edgekit's
preconditions, numerical check and report.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from .base import GraphPass, PassChanges, PassContext
from .config import PassConfig, param
from .patterns import add_initializer, matches_any, remove_if_unused, require_weight_matmuls


@dataclass
class Int8Config(PassConfig):
    per_channel: bool = param(True, help="one scale per output channel")
    reduce_range: bool = param(False, help="7-bit weights (for CPUs without VNNI that overflow)")
    exclude: list[str] = param([], help="module-name patterns left in FP32")


def fold_weight_transposes(model: ir.Model, exclude: list[str] | None = None) -> tuple[list[str], int]:
    """Rewrite `Transpose(W) -> MatMul` as `W^T -> MatMul` (a new (K, N) initializer). Returns (MatMul node
    names, nodes removed). Other quantizers (ORT's) only see MatMuls fed by an initializer."""
    names, removed = [], 0
    for m in require_weight_matmuls(model, "int8"):
        if exclude and matches_any(m.name, exclude):
            continue
        names.append(m.node.name)
        if m.transpose is None:
            continue
        kn = m.kn()
        m.node.replace_input_with(1, add_initializer(model.graph, kn, f"{m.name}.weight_kn"))
        removed += remove_if_unused(model, m.transpose)
        if m.weight.is_initializer() and not m.weight.uses():
            model.graph.initializers.pop(m.weight.name, None)
    return names, removed


class Int8Pass(GraphPass):
    name = "int8"
    Config = Int8Config

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        require_weight_matmuls(model, self.name, ctx.graph)

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        nodes_before = len(list(model.graph))
        names, removed = fold_weight_transposes(model, self.config.exclude)
        touched = list(names)
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
            onnx.save(ir.to_proto(model), src)
            with _quiet():
                quantize_dynamic(
                    src,
                    dst,
                    op_types_to_quantize=["MatMul"],
                    nodes_to_quantize=names,
                    per_channel=self.config.per_channel,
                    reduce_range=self.config.reduce_range,
                    weight_type=QuantType.QInt8,
                    extra_options={"MatMulConstBOnly": True},
                )
            quantized = ir.load(dst)
            # materialise tensors before the temp dir goes away
            for v in quantized.graph.initializers.values():
                v.const_value = ir.Tensor(v.const_value.numpy(), name=v.name)
        _replace_model_contents(model, quantized)
        nodes_after = len(list(model.graph))
        return PassChanges(
            nodes_added=max(nodes_after - nodes_before + removed, 0),
            nodes_removed=removed,
            initializers_touched=touched,
            notes={"engine": "onnxruntime.quantization.quantize_dynamic", "matmuls": len(names)},
        )


@contextlib.contextmanager
def _quiet():
    """quantize_dynamic logs a pre-processing hint on the root logger for every call; it is noise here."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _replace_model_contents(model: ir.Model, new: ir.Model) -> None:
    """In-place pass contract: the caller's `model` object must end up holding the new graph."""
    model.graph = new.graph  # opset imports live on the graph in onnx_ir
