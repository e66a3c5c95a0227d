"""FP16 and INT8 passes: the models run in ORT with the same FP32 interface and bounded error."""

from __future__ import annotations

import platform
from pathlib import Path

import onnx_ir as ir
import pytest

from edgekit.export import DecoderSpec, build_decoder, build_embed_tokens, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.passes import PassPreconditionError, make_pass
from edgekit.passes.calibration import sample_feeds
from edgekit.passes.check import check_models

SMALL = ModelConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
SPEC = DecoderSpec.from_model_config(SMALL)


def _io(model):
    return ([(v.name, v.dtype) for v in model.graph.inputs], [(v.name, v.dtype) for v in model.graph.outputs])


def test_fp16_keeps_fp32_io_and_sensitive_ops():
    model = build_decoder(random_weights(SMALL, 0), SPEC)
    io, before = _io(model), ir.to_proto(model).SerializeToString()
    report = make_pass("fp16")(model).report
    assert _io(model) == io
    assert 0.45 < report.size_after / report.size_before < 0.55
    f16 = ir.DataType.FLOAT16
    for node in model.graph:  # norms and softmax still read FP32
        if node.op_type in ("Softmax", "ReduceMean", "Sqrt"):
            assert all(v is None or v.dtype != f16 for v in node.inputs)
    errs = {e.name: e for e in check_models(before, model, sample_feeds(model, 3))}
    assert errs["logits"].rel_l2 < 5e-3


def test_fp16_embedding_table():
    model = build_embed_tokens(random_weights(SMALL, 0), SPEC)
    before = ir.to_proto(model).SerializeToString()
    report = make_pass("fp16")(model).report
    assert report.size_after * 2 == report.size_before
    assert check_models(before, model, sample_feeds(model, 2))[0].rel_l2 < 1e-3


def _has_vnni() -> bool:
    """ORT's u8s8 MatMulInteger saturates on x86 CPUs without VNNI (AVX2's VPMADDUBSW adds pairs into int16):
    ORT's quantization docs advise 7-bit weights (`reduce_range`) there."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return platform.machine() not in ("x86_64", "AMD64") or any(f in flags for f in ("avx512_vnni", "avx_vnni"))


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(
            "int8",
            marks=pytest.mark.skipif(
                not _has_vnni(), reason="this x86 CPU has no VNNI: full-range u8s8 MatMulInteger saturates on it"
            ),
        ),
        "int8:reduce_range=true",
    ],
)
def test_int8_dynamic(spec):
    model = build_decoder(random_weights(SMALL, 0), SPEC)
    io, before = _io(model), ir.to_proto(model).SerializeToString()
    report = make_pass(spec)(model).report
    assert _io(model) == io and report.size_after < 0.3 * report.size_before
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in model.graph)
    errs = {e.name: e for e in check_models(before, model, sample_feeds(model, 3))}
    assert errs["logits"].rel_l2 < 0.05


def test_int8_precondition():
    model = build_embed_tokens(random_weights(SMALL, 0), SPEC)
    with pytest.raises(PassPreconditionError, match="no MatMul"):
        make_pass("int8")(model)


def test_int8_blocked_dequantize_for_npu_targets():
    """qdq-blocked (orin, x1): weight-only INT8 as symmetric blocked DequantizeLinear (axis 0) feeding each MatMul,
    no ORT dynamic-quantization ops; the integers are int4_encode's quantizer at 8 bits, and ORT runs the graph."""
    import numpy as np

    model = build_decoder(random_weights(SMALL, 0), SPEC)
    io, before = _io(model), ir.to_proto(model).SerializeToString()
    report = make_pass("int8:format=qdq-blocked,block=32")(model).report
    assert _io(model) == io and report.notes["encoding"] == "DequantizeLinear-int8"
    assert not any(n.op_type in ("MatMulInteger", "DynamicQuantizeLinear") for n in model.graph)
    dqs = [n for n in model.graph if n.op_type == "DequantizeLinear"]
    assert len(dqs) == report.notes["matmuls"] == 7 * SMALL.layers + 1
    for dq in dqs:
        q, s = dq.inputs[0], dq.inputs[1]
        assert q.dtype == ir.DataType.INT8 and dq.attributes["axis"].as_int() == 0
        assert dq.attributes["block_size"].as_int() == 32 and s.shape[0] * 32 == q.shape[0]
        assert np.abs(q.const_value.numpy()).max() <= 127
        assert [u.node.op_type for u in dq.outputs[0].uses()] == ["MatMul"]
    assert report.size_after < 0.3 * report.size_before
    errs = {e.name: e for e in check_models(before, model, sample_feeds(model, 3))}
    assert errs["logits"].rel_l2 < 0.02  # weight-only: tighter than the dynamic path's bound


def test_int8_npu_targets_refuse_reduce_range():
    from edgekit.errors import ConfigError

    with pytest.raises(ConfigError, match="reduce_range"):
        make_pass("int8:format=qdq-blocked,reduce_range=true")
