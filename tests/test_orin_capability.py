"""The TensorRT 10.3 capability check: the shipped operator table, the rules read off a graph, the fixes the
orin build applies, the refusal naming the node (in the build and in `edgekit engine capability`), and the DLA
constraints for DLA-planned graphs. Graphs are written here with onnx.helper; nothing needs TensorRT."""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit import names
from edgekit.cli.app import main
from edgekit.errors import ConfigError
from edgekit.target import BuildInputs
from edgekit.targets.orin.build import prepare
from edgekit.targets.orin.capability import check_model, refuse_unsupported
from edgekit.targets.orin.optable import load_table, parse_operators_md
from edgekit.targets.orin.trt_graphs import prepare_model


def _model(nodes, inputs, outputs, inits=(), opset=21, extra_opsets=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    ops = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def _ir(proto) -> ir.Model:
    return ir.from_proto(proto)


def _vi(name, dtype=TensorProto.FLOAT, shape=(2, 8)):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def test_the_table_is_onnx_tensorrt_with_its_source_and_the_10_3_delta():
    t = load_table()
    assert t.tensorrt == "10.3" and t.source["commit"] == "96e781103cfc4adf4a6bb557e94bac8e693f6f4c"
    assert t.source["url"].endswith("96e781103cfc4adf4a6bb557e94bac8e693f6f4c/docs/operators.md")
    assert t.get("Slice").restrictions == ""  # 10.3 GA: tensor `axes` for Slice
    assert "10.3 GA" in t.source["changelog_deltas"][1]["release"]
    assert t.get("DequantizeLinear").types == ("INT8", "FP8", "INT4")
    assert not t.get("BitShift").supported and not t.get("Unique").supported
    assert t.get("LayerNormalization").supported and t.opset_range == (9, 20)


def test_parse_operators_md_reads_rows_types_and_restrictions():
    md = (
        "TensorRT 10.9 supports operators in the inclusive range of opset 9 to opset 22.\n"
        "| Operator | Supported | Supported Types | Restrictions |\n|---|---|---|---|\n"
        "| Abs                       | Y          | FP32, FP16 |\n"
        "| BitShift                  | N          |\n"
        "| TopK                      | Y          | FP32, INF64 | `sorted` must be 1.\n"
    )
    opsets, ops = parse_operators_md(md)
    assert opsets == (9, 22)
    assert ops["Abs"] == {"supported": True, "types": ["FP32", "FP16"], "restrictions": ""}
    assert ops["BitShift"]["supported"] is False
    assert ops["TopK"] == {"supported": True, "types": ["FP32", "INT64"], "restrictions": "`sorted` must be 1."}


def test_ops_tensorrt_lacks_are_named_with_their_reason():
    shift = numpy_helper.from_array(np.array([1], np.uint32), "s")
    proto = _model(
        [
            helper.make_node("BitShift", ["x", "s"], ["y"], name="my_shift", direction="LEFT"),
            helper.make_node("FancyOp", ["x"], ["z"], name="my_contrib", domain="com.example"),
            helper.make_node("Unique", ["x"], ["u"], name="my_unique"),
        ],
        [_vi("x", TensorProto.UINT32)],
        [_vi("y", TensorProto.UINT32), _vi("z"), _vi("u", TensorProto.UINT32, (None,))],
        [shift],
        extra_opsets=[("com.example", 1)],
    )
    report = check_model(_ir(proto), "toy.onnx")
    by_node = {f.node: f for f in report.findings}
    assert set(by_node) == {"my_shift", "my_contrib", "my_unique"}
    assert "unsupported (N)" in by_node["my_shift"].reason and by_node["my_shift"].refused
    assert "not an ONNX standard op" in by_node["my_contrib"].reason
    with pytest.raises(ConfigError) as err:
        refuse_unsupported([report], "/models")
    line = str(err.value)
    assert "\n" not in line and line.startswith("/models/toy.onnx: node 'my_shift' (BitShift)")
    assert "(and 2 more node(s))" in line


def test_restrictions_read_off_the_graph():
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    proto = _model(
        [
            helper.make_node("ReduceSum", ["x", "axes"], ["r"], name="dyn_axes"),
            helper.make_node("LayerNormalization", ["x", "g"], ["ln", "mean"], name="ln2", axis=-1),
            helper.make_node("Identity", ["mean"], ["mean_out"], name="use_mean"),
            helper.make_node("Mul", ["x", "x"], ["ok"], name="fine"),
        ],
        [_vi("x"), axes],
        [_vi("r", shape=(None,)), _vi("ln"), _vi("mean_out", shape=(2, 1)), _vi("ok")],
        [numpy_helper.from_array(np.ones(8, np.float32), "g")],
        opset=18,
    )
    report = check_model(_ir(proto), "r.onnx")
    reasons = {f.node: f.reason for f in report.findings}
    assert reasons == {"dyn_axes": "`axes` must be an initializer or a constant", "ln2": reasons["ln2"]}
    assert "only the first output" in reasons["ln2"]


def _dq_model(q, scale, axis, block, consumer, zero=None):
    """A constant DequantizeLinear feeding `consumer` ("MatMul" or "Gather")."""
    inits = [numpy_helper.from_array(q, "w.qweight"), numpy_helper.from_array(scale, "w.scales")]
    dq_in = ["w.qweight", "w.scales"]
    if zero is not None:
        inits.append(numpy_helper.from_array(zero, "w.zero"))
        dq_in.append("w.zero")
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    dq = helper.make_node("DequantizeLinear", dq_in, ["w"], name="the_dq", **attrs)
    if consumer == "MatMul":
        use = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
        x = _vi("x", shape=(1, q.shape[0]))
    else:
        use = helper.make_node("Gather", ["w", "x"], ["y"], name="gather", axis=0)
        x = helper.make_tensor_value_info("x", TensorProto.INT64, [1, 3])
    return _model([dq, use], [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def _run(proto, feeds):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_quantization_fixes_keep_the_numbers_and_pass_the_check_after():
    rng = np.random.default_rng(0)
    q4 = rng.integers(-7, 8, (16, 8)).astype(ml_dtypes.int4)
    table = _dq_model(q4, rng.uniform(0.01, 0.1, (16, 2)).astype(np.float32), 1, 4, "Gather")
    q8 = rng.integers(-127, 128, (16, 8)).astype(np.int8)
    lm_head = _dq_model(q8, rng.uniform(0.01, 0.1, (2, 8)).astype(np.float32), 0, 8, "MatMul")
    gemm4 = _dq_model(q4, rng.uniform(0.01, 0.1, (2, 8)).astype(np.float32), 0, 8, "MatMul")
    feeds = {"table": {"x": np.array([[0, 5, 15]], np.int64)}, "lm_head": {"x": rng.standard_normal((1, 16))}}
    feeds["gemm4"] = feeds["lm_head"]
    for name, proto, fix in (("table", table, "fold-dequantize"), ("lm_head", lm_head, "per-channel-int8")):
        feed = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds[name].items()}
        want = _run(proto, feed)
        model = _ir(proto)
        report = check_model(model, f"{name}.onnx")
        assert [(f.node, f.fix) for f in report.findings] == [("the_dq", fix)]
        prepare_model(model, f"{name}.onnx", report)
        assert check_model(model, f"{name}.onnx").findings == []
        got = _run(ir.to_proto(model), feed)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.01  # FP16 compute, INT8 re-quantized
    report = check_model(_ir(gemm4), "gemm4.onnx")
    assert report.findings == []  # INT4 weight-only GEMM: what TensorRT takes as it is


def test_a_nonzero_zero_point_is_refused():
    q8 = np.ones((16, 8), np.int8)
    proto = _dq_model(q8, np.full((8,), 0.1, np.float32), 1, 0, "MatMul", zero=np.full((8,), 3, np.int8))
    (finding,) = check_model(_ir(proto), "zp.onnx").findings
    assert finding.node == "the_dq" and finding.refused and "zero point must be all zeros" in finding.reason


def test_dla_constraints_fall_back_or_refuse():
    proto = _model(
        [
            helper.make_node("Cast", ["x"], ["h"], name="to_half", to=TensorProto.FLOAT16),
            helper.make_node("Relu", ["h"], ["r"], name="relu_fp16"),
            helper.make_node("Add", ["x", "x"], ["a"], name="add_fp32"),
            helper.make_node("Erf", ["x"], ["e"], name="erf"),
        ],
        [_vi("x", shape=(1, 4, 8, 8))],
        [_vi("r", TensorProto.FLOAT16, (1, 4, 8, 8)), _vi("a", shape=(1, 4, 8, 8)), _vi("e", shape=(1, 4, 8, 8))],
    )
    report = check_model(_ir(proto), "v.onnx", dla=True)
    reasons = {f.node: (f.reason, f.fix, f.device) for f in report.findings}
    assert "relu_fp16" not in reasons  # FP16 activation: a DLA layer
    assert reasons["add_fp32"] == ("DLA takes FP16 and INT8 only (input is FP32)", "gpu-fallback", "dla")
    assert reasons["erf"][0] == "not a layer the DLA runs" and reasons["to_half"][0] == "not a layer the DLA runs"
    assert report.refused == [] and report.supported_nodes == report.nodes  # DLA findings run on the GPU
    strict = check_model(_ir(proto), "v.onnx", dla=True, gpu_fallback=False)
    assert {f.node for f in strict.refused} == {"to_half", "add_fp32", "erf"}
    dynamic = check_model(_ir(proto), "v.onnx", dla=True, dla_static=False)
    assert {f.reason for f in dynamic.findings} == {"DLA needs static shapes (profile min = opt = max)"}


def test_the_build_stops_in_one_line_naming_the_node(small_onnx_dir, tmp_path):
    graphs = tmp_path / "graphs"
    shutil.copytree(small_onnx_dir, graphs)
    decoder = onnx.load(str(graphs / names.DECODER))
    logits = next(o for o in decoder.graph.output if o.name == names.LOGITS)
    decoder.graph.node.append(helper.make_node("Hardmax", [names.LOGITS], ["hm"], name="bad_hardmax", axis=-1))
    decoder.graph.node.append(helper.make_node("Det", ["det_in"], ["det_out"], name="the_det"))
    decoder.graph.input.append(_vi("det_in", shape=(3, 3)))
    decoder.graph.output.append(helper.make_tensor_value_info("det_out", TensorProto.FLOAT, []))
    assert logits is not None
    onnx.save(decoder, str(graphs / names.DECODER))
    (tmp_path / "work").mkdir()
    with pytest.raises(ConfigError) as err:
        prepare(BuildInputs(graphs=graphs, work=tmp_path / "work", model_dir=tmp_path))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{graphs / names.DECODER}: node 'the_det' (Det)")
    assert "bad_hardmax" not in line  # Hardmax is supported at 10.3 (axis static)


def test_engine_capability_cli_refuses_a_cpu_int4_bundle(tmp_path, capsys):
    from edgekit.build import build

    cpu = build("cpu", tmp_path / "cpu-int4", parity=False, recipe="int4").bundle
    assert main(["engine", "capability", str(cpu)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(MatMulNBits) not supported by TensorRT" in err[0]
    assert "op of domain 'com.microsoft'" in err[0]
    assert main(["engine", "capability", str(cpu / names.EMBED_TOKENS), "--json"]) == 2  # GatherBlockQuantized
    out = capsys.readouterr().out
    assert '"op": "GatherBlockQuantized"' in out
