"""`edgekit optimize` on ONNX files edgekit did not write: one file or a folder of them, nodes left unnamed,
external data, an old opset, symbolic input dims, and what it refuses (one line each)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.cli.app import main
from edgekit.errors import ConfigError
from edgekit.onnx_model import load_onnx, upgrade_opset
from edgekit.passes import make_pass
from edgekit.passes.calibration import dim_value, sample_feeds
from edgekit.passes.onnx_file import optimize_onnx_file, optimize_onnx_folder


def mlp(seed: int = 0, opset: int = 17, k: int = 64, n: int = 32) -> onnx.ModelProto:
    """Two MatMuls and a Relu written with onnx.helper, names left empty, symbolic batch and sequence dims."""
    rng = np.random.default_rng(seed)
    w0 = numpy_helper.from_array(rng.standard_normal((k, 128)).astype(np.float32) / 8, "fc0.weight")
    w1 = numpy_helper.from_array(rng.standard_normal((128, n)).astype(np.float32) / 11, "fc1.weight")
    nodes = [
        helper.make_node("MatMul", ["x", "fc0.weight"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "fc1.weight"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "sequence_length", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", "sequence_length", n])],
        [w0, w1],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_int8_as_blocked_dequantize_upgrades_an_opset_17_file(tmp_path, capsys):
    """Blocked INT8 DequantizeLinear (`block_size`) is opset 21, as INT4's is: the file is upgraded first."""
    src, out = tmp_path / "mlp.onnx", tmp_path / "mlp-int8.onnx"
    onnx.save(mlp(), src)
    assert main(["optimize", str(src), "-o", str(out), "--pass", "int8:format=qdq-blocked", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["passes"]
    assert report["notes"]["opset_upgraded"] == "17 -> 21"
    x = np.random.default_rng(1).standard_normal((2, 5, 64)).astype(np.float32)
    ref, got = _run(src, x), _run(out, x)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_cli_quantizes_an_unnamed_opset_17_file_for_orin(tmp_path, capsys):
    src, out = tmp_path / "mlp.onnx", tmp_path / "mlp-int4.onnx"
    onnx.save(mlp(), src)
    assert main(["optimize", str(src), "-o", str(out), "--pass", "int4:block=32,format=qdq-blocked", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (report,) = doc["passes"]
    assert report["notes"]["opset_upgraded"] == "17 -> 21"  # blocked DequantizeLinear needs opset 21
    assert report["notes"]["nodes_named"] == 3
    assert [c["name"] for c in report["check"]] == ["y"] and report["check"][0]["rel_l2"] < 0.2
    model = onnx.load(out)
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {21} and model.ir_version >= 10
    names = [node.name for node in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    x = np.random.default_rng(1).standard_normal((2, 5, 64)).astype(np.float32)
    ref, got = _run(src, x), _run(out, x)  # ONNX Runtime loads and runs it; close to the float model
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.2


def test_external_data_is_kept(tmp_path):
    src, out = tmp_path / "ext.onnx", tmp_path / "q" / "ext-int4.onnx"
    onnx.save(mlp(), src, save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    res = optimize_onnx_file(src, out, [make_pass("int4:block=32")])
    assert res.reports[0].check is not None
    assert (out.parent / "ext-int4.onnx.data").is_file()
    proto = onnx.load(out, load_external_data=False)
    external = {t.name for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert {"fc0.qweight", "fc1.qweight"} <= external  # the weights stay outside
    x = np.random.default_rng(2).standard_normal((1, 4, 64)).astype(np.float32)
    assert np.linalg.norm(_run(out, x) - _run(src, x)) / np.linalg.norm(_run(src, x)) < 0.2
    assert not list(out.parent.glob(".*partial*"))  # nothing half-written left behind


def test_a_folder_of_graphs(tmp_path):
    src = tmp_path / "graphs"
    src.mkdir()
    onnx.save(mlp(0), src / "a.onnx")
    onnx.save(mlp(1, opset=21), src / "b.onnx")
    (src / "README.txt").write_text("kept")
    res = optimize_onnx_folder(src, tmp_path / "out", [make_pass("int4:block=32,method=rtn")])
    assert sorted(r.graph for r in res.reports) == ["a.onnx", "b.onnx"]
    assert (tmp_path / "out" / "README.txt").read_text() == "kept"
    for name in ("a.onnx", "b.onnx"):
        ops = {n.op_type for n in onnx.load(tmp_path / "out" / name).graph.node}
        assert "MatMulNBits" in ops and "MatMul" not in ops


def test_int4_calibration_size_on_a_file_is_the_pass_own(tmp_path):
    """Feeds generated for a file are as many and as long as int4's `calib` and `seq` say (before, a fixed
    16 x 32 replaced them silently): the default 128 x 32 tokens, and what a spec sets."""
    src = tmp_path / "mlp.onnx"
    onnx.save(mlp(), src)
    for spec, tokens in (("int4:block=32", 128 * 32), ("int4:block=32,method=gptq,calib=3,seq=8", 3 * 8)):
        res = optimize_onnx_file(src, tmp_path / "out.onnx", [make_pass(spec)], overwrite=True)
        assert set(res.reports[0].notes["calibration_tokens"].values()) == {tokens}, spec


def test_integer_inputs_a_gather_indexes_get_ids_below_its_table_rows():
    """Whatever the input is called (not only input_ids); an integer input no Gather indexes stays zeros."""
    tokens = helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "seq"])
    flags = helper.make_tensor_value_info("flags", TensorProto.INT64, ["batch", "seq"])
    table = numpy_helper.from_array(np.zeros((7, 4), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "tokens"], ["e"]), helper.make_node("Identity", ["flags"], ["f"])],
        "g",
        [tokens, flags],
        [
            helper.make_tensor_value_info("e", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("f", TensorProto.INT64, None),
        ],
        [table],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    feeds = sample_feeds(model, 3, seq=64, seed=0)
    got = np.concatenate([f["tokens"].ravel() for f in feeds])
    assert got.max() < 7 and len(np.unique(got)) > 1  # drawn, below the table's rows
    assert all(not f["flags"].any() for f in feeds)


def test_feeds_follow_the_declared_inputs_and_dims_can_be_set():
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
    mask = helper.make_tensor_value_info(
        "attention_mask", TensorProto.INT64, ["batch_size", "past_sequence_length + 1"]
    )
    table = numpy_helper.from_array(np.zeros((50, 8), np.float32), "embed.weight")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "input_ids"], ["e"])],
        "g",
        [ids, mask],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
        [table],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    feeds = sample_feeds(model, 2, seq=16, seed=0)
    assert feeds[0]["input_ids"].shape == (1, 16) and feeds[0]["input_ids"].max() < 50  # the table's rows
    assert feeds[0]["attention_mask"].shape == (1, 1) and feeds[1]["attention_mask"].shape == (1, 5)
    (fixed,) = sample_feeds(model, 1, dims={"sequence_length": 7, "batch_size": 2})
    assert fixed["input_ids"].shape == (2, 7)
    assert dim_value("past_sequence_length + 1", {"past_seq": 3}) == 4
    decoder = helper.make_graph(
        [helper.make_node("Identity", ["m"], ["o"])],
        "d",
        [
            helper.make_tensor_value_info("e", TensorProto.FLOAT, ["batch", "seq", 4]),
            helper.make_tensor_value_info("m", TensorProto.INT64, ["batch", "total_seq"]),
        ],
        [helper.make_tensor_value_info("o", TensorProto.INT64, None)],
    )
    for feed in sample_feeds(ir.from_proto(helper.make_model(decoder)), 2, dims={"seq": 9}):
        past = feed["m"].shape[1] - 9  # total_seq follows an overridden seq
        assert feed["e"].shape == (1, 9, 4) and past in (0, 4)
    assert dim_value("height", {}) == 1


def test_dim_flag_reaches_the_check(tmp_path, capsys):
    src, out = tmp_path / "mlp.onnx", tmp_path / "o.onnx"
    onnx.save(mlp(), src)
    argv = ["optimize", str(src), "-o", str(out), "--pass", "int4:block=32,method=rtn", "--dim", "sequence_length=3"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passes"][0]["check_samples"] == 4


def test_upgrade_keeps_the_weight_tensors():
    model = ir.from_proto(mlp())
    before = {n: v.const_value for n, v in model.graph.initializers.items()}
    new = upgrade_opset(model, 21)
    assert new.graph.opset_imports[""] == 21
    assert all(new.graph.initializers[n].const_value is t for n, t in before.items())
    assert upgrade_opset(new, 21) is new


@pytest.mark.parametrize(
    ("content", "args", "needle"),
    [
        (b"not a model", ["--pass", "int4"], "not a readable ONNX model"),
        (None, ["--pass", "heads"], "needs edgekit's graph roles"),
        (None, ["--pass", "lora:adapters=x"], "needs edgekit's graph roles"),
        (None, ["--pass", "int4", "--calib", "2"], "--calib"),
        (None, ["--pass", "int4", "--dim", "seq"], "--dim: expected NAME=N"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, content, args, needle):
    src = tmp_path / "m.onnx"
    if content is None:
        onnx.save(mlp(), src)
    else:
        src.write_bytes(content)
    argv = ["optimize", str(src), "-o", str(tmp_path / "o.onnx"), *args]
    assert main(argv) != 0
    assert needle in _one_line(capsys.readouterr().err)
    assert main([*argv, "--json"]) != 0
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] and error["message"]
    assert not (tmp_path / "o.onnx").exists()


def test_missing_external_data_is_refused_naming_the_file(tmp_path):
    src = tmp_path / "ext.onnx"
    onnx.save(mlp(), src, save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    (tmp_path / "ext.onnx.data").unlink()
    with pytest.raises(Exception, match="ext.onnx.data is missing"):
        load_onnx(src)
    with pytest.raises(ConfigError, match="not found"):
        load_onnx(tmp_path / "nope.onnx")
