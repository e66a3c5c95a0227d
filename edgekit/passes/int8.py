"""INT8 weight MatMuls in the weight format `format` names (`weight_formats.py`), as in `int4`:

- `ort-dynamic` — ONNX Runtime's dynamic quantization (`quantize_dynamic`: MatMulInteger with DynamicQuantizeLinear on
  the activation), wrapped as a pass. Why wrap rather than reimplement: that path is what ORT's CPU kernels are tuned
  for. The wrapper adds what the bare call lacks: it folds our `Transpose -> MatMul` weights first (ORT only
  quantizes MatMuls whose B is an initializer), restricts itself to weight MatMuls, and gets edgekit's
  preconditions, numerical check and report.
- a weight-only format (`qdq-blocked`, `matmulnbits`, or a target's own): the same symmetric block quantizer as the
  int4 pass at 8 bits (`int4_encode`), written by the format's encoder; `qdq-blocked` is a `DequantizeLinear`
  (opset 21, axis 0, INT8 (K, N), scale (K/B, N)) feeding the original MatMul, which the X1 compiler reads as
  `XL_GEMM.W8A8` and any opset-21 runtime runs. ORT's dynamic format is a pair of integer ops no NPU compiler reads.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.ir_values import const_array

from .base import GraphPass, PassChanges, PassContext, PassPreconditionError
from .config import PassConfig, param
from .int4_encode import quantize_blocks
from .patterns import add_initializer, matches_any, remove_if_unused, require_weight_matmuls
from .weight_formats import MATMUL, MATMUL_DYNAMIC, WeightFormat, WritesWeightFormat


@dataclass
class Int8Config(WritesWeightFormat, PassConfig):
    format_uses = (MATMUL, MATMUL_DYNAMIC)

    per_channel: bool = param(True, help="one scale per output channel")
    reduce_range: bool = param(False, help="7-bit weights (for CPUs without VNNI that overflow)")
    exclude: list[str] = param([], help="module-name patterns left in FP32")
    format: str | None = param(
        None,
        help="weight format: ort-dynamic (ONNX Runtime's MatMulInteger), qdq-blocked (weight-only blocked "
        "DequantizeLinear INT8), matmulnbits, or one a target registers; unset: the build target's first that "
        "fits, else ort-dynamic",
    )
    target: str | None = param(
        None,
        help="deprecated: the format this target takes (target=cpu: ort-dynamic; orin/x1: qdq-blocked); use format",
    )
    block: int = param(
        64,
        choices=(16, 32, 64, 128),
        help="weight-only formats: block along K (the largest of these <= block that divides K); ort-dynamic "
        "uses per_channel",
    )

    def validate(self, where: str) -> None:
        self.check_format(where)

    def format_bits(self) -> set[int]:
        return {8}

    def format_refusal(self, fmt: WeightFormat) -> str | None:
        if self.reduce_range and MATMUL_DYNAMIC not in fmt.uses:
            return (
                f"reduce_range: 7-bit weights are an ONNX Runtime dynamic-quantization workaround; format "
                f"{fmt.name} takes full INT8 (set reduce_range=false)"
            )
        return super().format_refusal(fmt)


def fold_weight_transposes(model: ir.Model, exclude: list[str] | None = None) -> tuple[list[str], int]:
    """Rewrite `Transpose(W) -> MatMul` as `W^T -> MatMul` (a new (K, N) initializer). Returns (MatMul node
    names, nodes removed). Other quantizers (ORT's) only see MatMuls fed by an initializer."""
    names: list[str] = []
    removed = 0
    for m in require_weight_matmuls(model, "int8"):
        if exclude and matches_any(m.name, exclude):
            continue
        if m.node.name is None:  # onnx_file names every node first; edgekit's exports name theirs
            raise PassPreconditionError(f"int8: the MatMul of {m.name} has no node name for the quantizer to select")
        names.append(m.node.name)
        if m.transpose is None:
            continue
        kn = m.kn()
        m.node.replace_input_with(1, add_initializer(model.graph, kn, f"{m.name}.weight_kn"))
        removed += remove_if_unused(model, m.transpose)
        if m.weight.is_initializer() and not m.weight.uses():
            model.graph.initializers.pop(m.weight_name, None)
    return names, removed


class Int8Pass(GraphPass):
    name = "int8"
    Config = Int8Config
    config: Int8Config  # what GraphPass.__init__ checks it is

    @property
    def format(self) -> WeightFormat:
        return self.config.weight_format()

    @property
    def dynamic(self) -> bool:
        """Whether ONNX Runtime's quantizer writes the result (ort-dynamic) rather than the format's encoder."""
        return MATMUL not in self.format.uses

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        mms = require_weight_matmuls(model, self.name, ctx.graph)
        if not self.dynamic:
            for m in mms:
                if not any(b <= self.config.block and m.k % b == 0 for b in (128, 64, 32, 16)):
                    raise ConfigError(
                        f"int8.block: no block of 16..{self.config.block} divides K={m.k} of {m.weight.name}"
                    )

    def min_opset(self) -> int | None:
        """The format's (blocked DequantizeLinear is opset 21; ORT's dynamic format needs no upgrade)."""
        return self.format.min_opset

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        if not self.dynamic:
            return self._transform_blocked(model)
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
                v.const_value = ir.Tensor(const_array(v), name=v.name)
        _replace_model_contents(model, quantized)
        nodes_after = len(list(model.graph))
        return PassChanges(
            nodes_added=max(nodes_after - nodes_before + removed, 0),
            nodes_removed=removed,
            initializers_touched=touched,
            notes={
                "engine": "onnxruntime.quantization.quantize_dynamic",
                "format": self.format.name,
                "matmuls": len(names),
            },
        )

    def _transform_blocked(self, model: ir.Model) -> PassChanges:
        """Each weight MatMul's B -> the format's INT8 encoding (qdq-blocked: DequantizeLinear(INT8 (K, N), scale
        (K/B, N))), symmetric, per output column and block of K (the X1's weight groups, numerics.md)."""
        cfg = self.config
        fmt = self.format
        encoder = fmt.encode_matmul
        assert encoder is not None  # `dynamic` is False only for formats that store weight MatMuls
        changes = PassChanges()
        blocks = set()
        for m in require_weight_matmuls(model, self.name):
            if cfg.exclude and matches_any(m.name, cfg.exclude):
                continue
            block = next((b for b in (128, 64, 32, 16) if b <= cfg.block and m.k % b == 0), cfg.block)
            blocks.add(block)
            transpose = m.transpose
            qw = quantize_blocks(m.kn().T, block, bits=8, symmetric=True, name=m.weight_name)
            added, removed = encoder(model, m.node, qw, m.name, {})
            changes.nodes_added += added
            changes.nodes_removed += removed
            changes.initializers_touched.append(m.weight_name)
            changes.nodes_removed += remove_if_unused(model, transpose)
            if m.weight.is_initializer() and not m.weight.uses():
                model.graph.initializers.pop(m.weight_name, None)
        changes.notes = {
            "format": fmt.name,
            "encoding": fmt.report_label(8),
            "matmuls": len(changes.initializers_touched),
            "blocks": sorted(blocks),
        }
        return changes


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
