"""`qembed`: the embedding table as blocked INT4/INT8, both encodings run in ONNX Runtime like numpy, the graph's
interface is unchanged, and bad configs are refused."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from edgekit.errors import ConfigError
from edgekit.export import DecoderSpec, build_embed_tokens, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.passes import make_pass
from edgekit.passes.base import PassPreconditionError, initializer_bytes
from edgekit.passes.check import session
from edgekit.passes.int4_encode import quantize_blocks

SMALL = ModelConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
IDS = np.array([[0, 1, 7, 255, 128, 7]], np.int64)


def _embed(seed=0):
    weights = random_weights(SMALL, seed)
    return build_embed_tokens(weights, DecoderSpec.from_model_config(SMALL)), weights["model.embed_tokens.weight"]


def _run(model):
    return session(model).run(None, {"input_ids": IDS})[0]


@pytest.mark.parametrize(
    "spec, op",
    [
        ("qembed:block=32", "GatherBlockQuantized"),
        ("qembed:block=32,format=qdq-blocked", "DequantizeLinear"),
        ("qembed:block=16,bits=8", "DequantizeLinear"),
    ],
)
def test_encodings_gather_the_numpy_dequantized_rows(spec, op):
    model, table = _embed()
    fp32_bytes = initializer_bytes(model)
    report = make_pass(spec)(model).report
    cfg = make_pass(spec).config
    assert op in {n.op_type for n in model.graph}
    assert "model.embed_tokens.weight" not in model.graph.initializers  # the float table is gone
    expected = quantize_blocks(np.asarray(table, np.float32), cfg.block, bits=cfg.bits).dequantize()[IDS]
    got = _run(model)
    assert got.dtype == np.float32 and got.shape == (1, IDS.shape[1], SMALL.hidden)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    # 4 bits + a float32 scale per block of 32 is 5/32 of FP32; 8 bits per 16 is 10/32 (plus graph overhead)
    assert report.size_after <= fp32_bytes * (cfg.bits + 32 / cfg.block) / 32 + 64
    assert report.notes["tables"]["model.embed_tokens.weight"]["rel_l2"] < (0.15 if cfg.bits == 4 else 0.01)


def test_interface_is_unchanged_and_error_is_small():
    model, table = _embed(1)
    inputs = [(v.name, v.dtype) for v in model.graph.inputs]
    outputs = [(v.name, v.dtype) for v in model.graph.outputs]
    make_pass("qembed:block=32")(model)
    assert [(v.name, v.dtype) for v in model.graph.inputs] == inputs
    assert [(v.name, v.dtype) for v in model.graph.outputs] == outputs
    got, ref = _run(model), np.asarray(table)[IDS]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.15
    # survives a save/load round trip (int4 initializers serialize packed)
    again = ir.from_proto(ir.to_proto(model))
    np.testing.assert_array_equal(_run(again), got)


def test_bad_configs_are_refused():
    with pytest.raises(ConfigError, match="qembed.format: gather-block-quantized stores 4-bit weights, not 8-bit"):
        make_pass("qembed:format=gather-block-quantized,bits=8")
    with pytest.raises(ConfigError, match="qembed.format: unknown weight format"):
        make_pass("qembed:format=gather")
    with pytest.raises(ConfigError, match="qembed.block"):
        make_pass("qembed:block=48")
    model, _ = _embed()
    with pytest.raises(ConfigError, match="does not divide"):
        make_pass("qembed:block=128")(model)  # hidden 64


def test_a_graph_without_an_embedding_table_is_refused():
    model, _ = _embed()
    make_pass("qembed")(model)
    with pytest.raises(PassPreconditionError, match="no Gather"):
        make_pass("qembed")(model)  # already quantized: nothing float left to gather from


@pytest.mark.parametrize("spec", ["qembed:block=32", "qembed:block=32,format=qdq-blocked", "qembed:block=16,bits=8"])
def test_calibration_reads_the_table_a_quantised_graph_gathers(tmp_path, spec):
    """Calibration (AWQ, head scores) feeds real embeddings: after qembed the table is codes and scales, and
    what calibration needs is what the graph gathers, not its first 2-D initializer."""
    from edgekit.names import EMBED_TOKENS
    from edgekit.passes.calibration import embedding_table

    model, table = _embed()
    ir.save(model, tmp_path / EMBED_TOKENS)
    assert np.array_equal(embedding_table(tmp_path), np.asarray(table, np.float32))
    make_pass(spec)(model)
    ir.save(model, tmp_path / EMBED_TOKENS)
    got = embedding_table(tmp_path)
    assert got.shape == (SMALL.vocab_size, SMALL.hidden) and got.dtype == np.float32
    assert np.array_equal(got[IDS[0]], _run(model)[0])
    assert np.abs(got - table).max() < np.abs(table).max() * 0.2  # dequantised values, not codes
