"""INT4: the quantizer, both encodings' packing against a numpy dequantization, and the pass end to end."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from edgekit.errors import ConfigError
from edgekit.export import DecoderSpec, build_decoder, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.names import DECODER
from edgekit.passes import PassContext, find_weight_matmuls, make_pass
from edgekit.passes.calibration import sample_feeds
from edgekit.passes.check import check_models, session
from edgekit.passes.int4_encode import (
    dequantize_matmulnbits,
    matmulnbits_tensors,
    pack_nibbles,
    qdq_tensors,
    quantize_blocks,
    unpack_nibbles,
)

SMALL = ModelConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def _decoder(seed=0):
    return build_decoder(random_weights(SMALL, seed), DecoderSpec.from_model_config(SMALL))


def test_nibble_packing_round_trips():
    codes = np.random.default_rng(0).integers(0, 16, (3, 5, 32)).astype(np.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 16)
    assert packed[0, 0, 0] == (codes[0, 0, 0] | (codes[0, 0, 1] << 4))  # element 0 in the low nibble
    np.testing.assert_array_equal(unpack_nibbles(packed, 32), codes)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_quantizer_error_is_bounded_by_half_a_step(symmetric, block):
    """The max/7 grid (scale_search off) never clips, so every weight is within half a step."""
    w = np.random.default_rng(1).standard_normal((24, 128)).astype(np.float32)
    qw = quantize_blocks(w, block, symmetric=symmetric)
    err = np.abs(qw.dequantize() - w).reshape(24, -1, block)
    assert (err <= qw.scales[..., None] / 2 + 1e-6).all()
    assert (qw.zero_points is None) == symmetric


def test_matmulnbits_layout_matches_numpy():
    k, n, block = 128, 24, 32
    w_kn = np.random.default_rng(2).standard_normal((k, n)).astype(np.float32)
    for symmetric in (True, False):
        qw = quantize_blocks(w_kn.T, block, symmetric=symmetric)
        b, scales, zp = matmulnbits_tensors(qw)
        assert b.shape == (n, k // block, block // 2) and scales.shape == (n, k // block)
        np.testing.assert_allclose(
            dequantize_matmulnbits(b, scales, zp, k=k, bits=4, block=block), qw.dequantize().T, rtol=0, atol=1e-6
        )


def test_matmulnbits_node_runs_in_ort_like_numpy():
    model = _decoder()
    make_pass("int4:block=32,method=rtn,symmetric=true")(model)
    nodes = [nd for nd in model.graph if nd.op_type == "MatMulNBits"]
    assert len(nodes) == 2 * 7 + 1 and not [
        nd for nd in model.graph if nd.op_type == "Transpose" and nd.inputs[0].is_initializer()
    ]
    nd = nodes[0]
    b, s = nd.inputs[1].const_value.numpy(), nd.inputs[2].const_value.numpy()
    w = dequantize_matmulnbits(b, s, None, k=nd.attributes["K"].as_int(), bits=4, block=32)
    x = ir.val("x", ir.DataType.FLOAT, [3, w.shape[0]])
    single = ir.node(
        "MatMulNBits",
        [x, *[ir.Value(name=v.name, const_value=v.const_value) for v in nd.inputs[1:]]],
        {a: nd.attributes[a].value for a in ("K", "N", "bits", "block_size")},
        domain="com.microsoft",
    )
    single.outputs[0].name, single.outputs[0].dtype = "y", ir.DataType.FLOAT
    g = ir.Graph(
        [x],
        single.outputs,
        nodes=[single],
        initializers=[v for v in single.inputs[1:]],
        opset_imports={"": 21, "com.microsoft": 1},
    )
    feed = np.random.default_rng(3).standard_normal((3, w.shape[0])).astype(np.float32)
    (y,) = session(ir.Model(g, ir_version=10)).run(None, {"x": feed})
    np.testing.assert_allclose(y, feed @ w, rtol=1e-4, atol=1e-4)


def test_qdq_encoding_is_symmetric_blocked_int4_and_matches_numpy():
    model = _decoder()
    make_pass("int4:block=32,format=qdq-blocked")(model)
    dqs = [nd for nd in model.graph if nd.op_type == "DequantizeLinear"]
    assert len(dqs) == 15
    for dq in dqs:
        w, s = dq.inputs[0].const_value, dq.inputs[1].const_value
        assert w.dtype == ir.DataType.INT4 and len(dq.inputs) == 2  # no zero point: TensorRT 10's form
        assert dq.attributes["axis"].as_int() == 0 and dq.attributes["block_size"].as_int() == 32
        k, n = w.shape
        assert tuple(s.shape) == (k // 32, n)
    assert model.opset_imports[""] == 21 and "com.microsoft" not in model.opset_imports
    qw = quantize_blocks(np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32), 32)
    wq, sc = qdq_tensors(qw)
    np.testing.assert_allclose(wq.astype(np.float32) * np.repeat(sc, 32, axis=0), qw.dequantize().T, atol=1e-6)
    assert wq.dtype == ml_dtypes.int4


def test_the_dequantizelinear_format_refuses_asymmetric():
    with pytest.raises(ConfigError, match="int4.symmetric: format qdq-blocked takes symmetric weights only"):
        make_pass("int4:format=qdq-blocked,symmetric=false")


@pytest.mark.parametrize(
    "spec",
    [
        "int4:block=32",
        "int4:block=32,format=qdq-blocked",
        "int4:block=64,symmetric=false",
        "int4:block=32,method=awq,mixed=2,calib=4,awq_grid=5",
    ],
)
def test_int4_logits_error_is_small(spec):
    model = _decoder()
    before = ir.to_proto(model).SerializeToString()
    report = make_pass(spec)(model).report
    errs = {e.name: e for e in check_models(before, model, sample_feeds(model, 3, seed=5))}
    assert errs["logits"].rel_l2 < 0.15
    assert report.size_after < 0.2 * report.size_before
    if "mixed=2" in spec:
        assert len(report.notes["kept"]) == 2 and report.notes["matmuls"]["int8"] == 2


def test_awq_beats_rtn_with_outlier_channels():
    """Real LLM activations have a few channels 10-50x larger; activation-aware scaling must pay off there."""
    rng = np.random.default_rng(0)
    k, n = 128, 64
    x = rng.standard_normal((256, k)).astype(np.float32)
    outliers = rng.choice(k, 4, replace=False)
    x[:, outliers] *= 30
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    xv = ir.val("x", ir.DataType.FLOAT, [256, k])
    wv = ir.Value(name="proj.weight", const_value=ir.Tensor(w, name="proj.weight"), shape=ir.Shape([n, k]))
    wv.dtype = ir.DataType.FLOAT
    t = ir.node("Transpose", [wv], {"perm": [1, 0]})
    mm = ir.node("MatMul", [xv, t.outputs[0]])
    mm.outputs[0].name, mm.outputs[0].dtype = "y", ir.DataType.FLOAT

    g = ir.Graph([xv], mm.outputs, nodes=[t, mm], initializers=[wv], opset_imports={"": 21})
    proto = ir.to_proto(ir.Model(g, ir_version=10))

    def model():
        return ir.from_proto(proto)

    feeds = [{"x": x}]
    errors = {}
    for method in ("rtn", "awq"):
        m = model()
        before = ir.to_proto(m).SerializeToString()
        make_pass(f"int4:block=32,method={method}")(m, PassContext(graph=DECODER, calibration={DECODER: feeds}))
        errors[method] = check_models(before, m, feeds)[0].rel_l2
    assert errors["awq"] < 0.8 * errors["rtn"], errors
    assert len(find_weight_matmuls(model())) == 1


# ----------------------------------------------------------------------------------------------------------------
# the vision encoder (graphs=vision) and its other large float weights (other_bits)
# ----------------------------------------------------------------------------------------------------------------
def test_graphs_param_selects_the_vision_encoder_and_default_stays_decoder():
    from edgekit.names import EMBED_TOKENS, VISION_ENCODER

    default = make_pass("int4")
    assert default.applies_to(DECODER) and not default.applies_to(VISION_ENCODER)
    both = make_pass("int4:graphs=decoder;vision")
    assert both.applies_to(DECODER) and both.applies_to(VISION_ENCODER) and not both.applies_to(EMBED_TOKENS)
    with pytest.raises(ConfigError, match="int4.graphs"):
        make_pass("int4:graphs=embed")


def test_vision_int4_in_the_pipeline_checks_image_features(tmp_path):
    from edgekit.export import export_model
    from edgekit.passes.pipeline import run_pipeline

    cfg = ModelConfig()
    src = tmp_path / "src"
    export_model(random_weights(cfg, 3), cfg, src, check=False)
    res = run_pipeline(src, tmp_path / "out", [make_pass("int4:block=64,graphs=vision,other_bits=8,mixed=1")])
    (report,) = res.reports
    assert report.graph == "vision_encoder.onnx"
    assert [e.name for e in report.check] == ["image_features"]
    assert report.worst().rel_l2 < 0.1
    assert report.notes["matmuls"]["int4"] > 0 and report.notes["matmuls"]["int8"] == 1  # mixed=1 on vision
    assert sorted(report.notes["other_weights"]) == [
        "vision_model.embeddings.patch_embedding.weight",
        "vision_model.embeddings.position_embedding.weight",
    ]
    assert report.size_after < 0.2 * report.size_before
    ops = {n.op_type for n in ir.load(tmp_path / "out" / "vision_encoder.onnx").graph}
    assert {"MatMulNBits", "DequantizeLinear", "Conv"} <= ops
    # the decoder was not asked for: copied byte for byte
    assert (tmp_path / "out" / "decoder_model_merged.onnx").read_bytes() == (
        src / "decoder_model_merged.onnx"
    ).read_bytes()


def test_vision_calibration_is_preprocessed_studies():
    from edgekit.export import VisionSpec, build_vision_encoder
    from edgekit.passes.calibration import vision_feeds

    cfg = ModelConfig()
    model = build_vision_encoder(random_weights(cfg, 0), VisionSpec.from_model_config(cfg))
    feeds = vision_feeds(model, 2)
    assert len(feeds) == 2
    x = feeds[0]["pixel_values"]
    assert x.shape[0] == 1 and x.shape[-1] == cfg.image_size and x.dtype == np.float32
    assert not np.allclose(feeds[0]["pixel_values"], feeds[1]["pixel_values"])  # two different studies


def test_decoder_calibration_feeds_are_image_tokens_then_the_trained_prompt(tmp_path):
    """`record_decoder_feeds` assembles the text as the reporter does (`edgekit.prompt.prompt_ids` with the
    generation config beside the graphs), so calibration sees the prompt the model was trained on."""
    import json

    from tokenizers import Tokenizer

    from edgekit.export.default import export_default
    from edgekit.ort import CpuBackend
    from edgekit.passes.calibration import record_decoder_feeds
    from edgekit.plugins import get_model_family
    from edgekit.prompt import prompt_ids

    weights = get_model_family().weights_dir()
    export_default(weights, tmp_path, check=False)
    (feed,) = record_decoder_feeds(tmp_path, 1)
    (study,) = get_model_family().calibration_studies(1)
    ids = prompt_ids(
        Tokenizer.from_file(str(weights / "tokenizer.json")),
        json.loads((weights / "generation_config.json").read_text()),
        study.modality,
        "",
    )
    text = CpuBackend.from_dir(tmp_path, intra_op_threads=1).embed(np.asarray([ids], np.int64))
    x = feed["inputs_embeds"]
    np.testing.assert_array_equal(x[:, -len(ids) :], text)
    assert feed["attention_mask"].shape == (1, x.shape[1]) and feed["position_ids"][0, -1] == x.shape[1] - 1


def test_fit_block_uses_the_largest_block_that_divides_each_k():
    model = _decoder()  # hidden 64, intermediate 128: K is 64 or 128
    with pytest.raises(ConfigError, match="does not divide"):
        make_pass("int4:block=128")(_decoder())
    make_pass("int4:block=128,fit_block=true")(model)
    blocks = {
        int(n.attributes["K"].as_int()): int(n.attributes["block_size"].as_int())
        for n in model.graph
        if n.op_type == "MatMulNBits"
    }
    assert blocks == {64: 64, 128: 128}
