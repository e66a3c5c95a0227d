"""The X1 compiler on the exported graphs: fused blocks, memory plan, host partitions and --strict."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgekit.targets.x1.compiler import CompileError, compile_graph, compile_model
from edgekit.targets.x1.emulator import Emulator
from edgekit.targets.x1.machine import load_machine

from x1_support import tiny_int4_dir


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    return tiny_int4_dir(tmp_path_factory.mktemp("x1c"))


def test_default_graphs_lower_without_host_partitions(int4_dir):
    progs = compile_model(int4_dir, load_machine())
    assert set(progs) == {"vision_encoder", "embed_tokens", "decoder"}
    dec = progs["decoder"]
    counts = dec.meta["instructions"]
    layers = 2
    assert dec.meta["host_partitions"] == 0
    assert dec.meta["fused"]["attention"] == layers
    assert counts["KVAPPEND"] == counts["XL_VMATMUL_PV"] == counts["VSOFTMAX"] == layers
    assert counts["XL_GEMM.W4A8"] == 7 * layers + 1  # q k v o gate up down per layer + lm_head
    assert counts["VRMSNORM"] == 2 * layers + 1 and counts["VSILU_MUL"] == layers
    assert counts["XL_ROPE_ROTATE"] == 2 * layers
    syms = [dec.symbols[i] for i, ins in enumerate(dec.instructions) if ins.mnemonic == "XL_GEMM.W4A8"]
    assert "/model/layers.0/self_attn/q_proj/MatMul" in syms
    vis = progs["vision_encoder"].meta["fused"]
    assert vis["conv"] == 1 and vis["gelu"] >= 1
    plan = dec.memory_plan
    assert 0 < plan["act_peak_bytes"] <= plan["act_capacity_bytes"]
    assert plan["act_peak_bytes"] < plan["sum_of_tensor_bytes"]  # lifetimes let tensors share bytes


def _mod_model(path: Path) -> Path:
    """x -> Mod(x, 3) + 1: Mod has no X1 lowering."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    three = helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    nodes = [
        helper.make_node("Mod", ["x", "three"], ["m"], name="/odd/Mod", fmod=1),
        helper.make_node("Add", ["m", "one"], ["y"], name="/odd/Add"),
    ]
    g = helper.make_graph(nodes, "odd", [x], [y], [three, one])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), str(path))
    return path


def test_a_rebuild_is_byte_identical(int4_dir, tmp_path):
    """A program is a function of its graph and machine: compiled twice (from a copy elsewhere), the files match
    byte for byte, so a rebuilt bundle's manifest and signature reproduce (compile time once made them differ)."""
    import shutil

    copy = shutil.copytree(int4_dir, tmp_path / "copy")
    machine = load_machine()
    first = {g: p.save(tmp_path / f"a-{g}.x1").read_bytes() for g, p in compile_model(int4_dir, machine).items()}
    again = {g: p.save(tmp_path / f"b-{g}.x1").read_bytes() for g, p in compile_model(copy, machine).items()}
    assert first.keys() == again.keys() == {"vision_encoder", "embed_tokens", "decoder"}
    assert all(first[g] == again[g] for g in first)


def test_strict_refuses_naming_the_node(tmp_path):
    path = _mod_model(tmp_path / "odd.onnx")
    with pytest.raises(CompileError, match=r"/odd/Mod.*op type Mod") as e:
        compile_graph(path, load_machine(), strict=True)
    assert "odd.onnx" in str(e.value)


def test_host_partition_runs_in_onnx_runtime(tmp_path):
    path = _mod_model(tmp_path / "odd.onnx")
    m = load_machine()
    prog = compile_graph(path, m, graph_name="odd")
    assert [h["op_type"] for h in prog.host] == ["Mod"] and "HOSTCALL" in prog.meta["instructions"]
    x = np.array([[1.5, -4.0, 7.0], [3.0, 8.5, -0.5]], np.float32)
    got = Emulator({"odd": prog}, m).run("odd", {"x": x}).outputs["y"]
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_fp32_weights_lower_to_f16_gemm(int4_dir):
    fp32 = int4_dir.parent / "onnx"
    prog = compile_graph(fp32 / "decoder_model_merged.onnx", load_machine(), graph_name="decoder")
    assert prog.meta["instructions"].get("XL_GEMM.F16") == 15 and "XL_GEMM.W4A8" not in prog.meta["instructions"]
