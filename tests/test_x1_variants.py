"""Every bundled recipe on x1: the generic build writes the X1's weight encoding into the recipe's passes, the x1
build compiles the recipe's graphs as they are (no second quantization), and the compiler folds constant
DequantizeLinear weights (patch Conv, position table, embedding table) so nothing runs on the host."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.build import build
from edgekit.errors import ConfigError
from edgekit.passes.int4 import RETARGET
from edgekit.plugins import get_model_family
from edgekit.targets.x1.compiler import compile_graph
from edgekit.targets.x1.emulator import Emulator
from edgekit.targets.x1.graph_view import dequantize_linear
from edgekit.targets.x1.machine import load_machine

RECIPES = get_model_family().recipe_names()
SAMPLE = files("edgekit.models") / "samples" / "cr_chest"
GEMM_OF = {"fp16": "XL_GEMM.F16", "int8": "XL_GEMM.W8A8"}  # every int4* recipe: W4A8


def test_every_bundled_recipe_is_covered():
    assert {"fp16", "int8", "int4", "int4-awq", "int4-sparse24", "int4-heads38", "int4-orin"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_builds_for_x1_and_reports(recipe, tmp_path):
    from edgekit.bundle import load_bundle
    from edgekit.reporter import Reporter
    from edgekit.targets.x1.program import load_program

    res = build("x1", tmp_path / recipe, parity=False, recipe=recipe)
    fig = res.figures["x1_compile"]
    assert fig["host_partitions"] == {"vision_encoder": 0, "embed_tokens": 0, "decoder": 0}
    assert [s["name"] for s in res.steps] == ["export", "recipe", "x1_compile"]  # no second quantization
    for rep in res.steps[1]["passes"]:
        if "format" in rep["config"]:  # filled from the x1 plug-in's formats; the deprecated target left unset
            assert rep["config"]["format"] == "qdq-blocked" and rep["config"]["target"] is None, rep["name"]
    bundle = load_bundle(res.bundle)
    decoder = load_program(bundle.component("x1_decoder"), load_machine())
    assert GEMM_OF.get(recipe, "XL_GEMM.W4A8") in decoder.meta["instructions"]
    report = Reporter(bundle).report(SAMPLE)
    assert report.text and report.target == "x1"
    assert report.cost["mj_total"] > 0 and report.cost["emulated_ms_total"] > 0


def test_default_x1_build_still_quantizes_itself(tmp_path):
    res = build("x1", tmp_path / "b", parity=False)
    int4 = next(s for s in res.steps if s["name"] == "int4")
    assert int4["params"] == {"block": 32, "format": "qdq-blocked"}
    # the manifest says what the pass chose on each graph and how far it moved the outputs, as a recipe's step does
    decoder = next(r for r in int4["passes"] if r["graph"] == "decoder_model_merged.onnx")
    assert (
        decoder["pass_name"] == "int4"
        and decoder["config"]["format"] == "qdq-blocked"
        and decoder["config"]["block"] == 32
    )
    assert decoder["notes"]["sequential_waves"] > 0 and decoder["check"] and decoder["check_samples"] > 0
    assert decoder["config"]["retarget"] is None and decoder["notes"]["retarget"] == RETARGET  # what ran, on record
    assert "on the INT4 graphs" in res.figures["x1_compile"]["source"]


def test_a_recipe_x1_cannot_take_is_refused_up_front_in_one_line(tmp_path, monkeypatch):
    recipe = tmp_path / "asym.toml"
    recipe.write_text('name = "asym"\n[[pass]]\nname = "int4"\nsymmetric = false\n')

    def no_export(*_a, **_k):
        raise AssertionError("exported before refusing")

    monkeypatch.setattr("edgekit.export.export_default", no_export)
    with pytest.raises(ConfigError) as err:
        build("x1", tmp_path / "b", parity=False, recipe=recipe)
    msg = str(err.value)
    assert "\n" not in msg and "for target x1" in msg and "int4.symmetric" in msg


# ----------------------------------------------------------------------------------------------------------------
# the compiler's constant folding of DequantizeLinear
# ----------------------------------------------------------------------------------------------------------------
def _int4(a: np.ndarray):
    return numpy_helper.from_array(a.astype(ml_dtypes.int4))


def _folding_model(path: Path) -> Path:
    """A patch Conv whose kernel is DequantizeLinear(int4, axis=1) -> Reshape, a position table added from a
    DequantizeLinear, then a MatMul fed by a blocked axis-0 DequantizeLinear (the GEMM pattern's)."""
    rng = np.random.default_rng(0)

    def init(name, a, int4=False):
        t = _int4(a) if int4 else numpy_helper.from_array(a)
        t.name = name
        return t

    inits = [
        init("conv.q", rng.integers(-7, 8, (4, 16)), True),
        init("conv.s", rng.uniform(0.01, 0.1, (4, 1)).astype(np.float32)),
        init("conv.shape", np.array([4, 1, 4, 4], np.int64)),
        init("pos.q", rng.integers(-7, 8, (4, 4)), True),
        init("pos.s", rng.uniform(0.01, 0.1, (4, 1)).astype(np.float32)),
        init("flat", np.array([1, 4, 4], np.int64)),
        init("fc.q", rng.integers(-7, 8, (4, 8)), True),
        init("fc.s", rng.uniform(0.01, 0.1, (1, 8)).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["conv.q", "conv.s"], ["conv.w2"], name="conv_DQ", axis=1, block_size=16),
        helper.make_node("Reshape", ["conv.w2", "conv.shape"], ["conv.w"], name="conv_Reshape"),
        helper.make_node("Conv", ["x", "conv.w"], ["c"], name="/patch/Conv", strides=[4, 4], kernel_shape=[4, 4]),
        helper.make_node("Reshape", ["c", "flat"], ["cf"], name="/patch/Reshape"),  # (1, 4 channels, 4 patches)
        helper.make_node("Transpose", ["cf"], ["ct"], name="/patch/Transpose", perm=[0, 2, 1]),
        helper.make_node("DequantizeLinear", ["pos.q", "pos.s"], ["pos"], name="pos_DQ", axis=1, block_size=4),
        helper.make_node("Add", ["ct", "pos"], ["h"], name="/pos/Add"),
        helper.make_node("DequantizeLinear", ["fc.q", "fc.s"], ["fc.weight_dq"], name="fc_DQ", axis=0, block_size=4),
        helper.make_node("MatMul", ["h", "fc.weight_dq"], ["y"], name="/fc/MatMul"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])
    g = helper.make_graph(nodes, "fold", [x], [y], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), str(path))
    return path


def test_constant_dequantize_folds_and_the_gemm_pattern_keeps_its_own(tmp_path):
    path = _folding_model(tmp_path / "fold.onnx")
    m = load_machine()
    prog = compile_graph(path, m, graph_name="fold")
    counts = prog.meta["instructions"]
    assert prog.meta["host_partitions"] == 0 and "HOSTCALL" not in counts
    assert prog.meta["fused"]["const_fold"] == 3  # conv DQ, its Reshape, the position DQ
    assert prog.meta["fused"]["conv"] == 1 and counts["XL_GEMM.W4A8"] == 1  # fc's DQ read as integers
    assert "fc.weight_dq" not in {t["name"] for t in prog.memory_plan.get("tensors", [])}
    x = np.random.default_rng(1).standard_normal((1, 1, 8, 8)).astype(np.float32)
    got = Emulator({"fold": prog}, m).run("fold", {"x": x}).outputs["y"]
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03  # FP16 conv, INT8 activations


@pytest.mark.parametrize(
    ("shape", "scale_shape", "axis", "block"),
    [((6, 8), (3, 8), 0, 2), ((6, 8), (6, 2), 1, 4), ((6, 8), (6,), 0, 0), ((6, 8), (), 1, 0)],
)
def test_dequantize_linear_matches_onnx_runtime(shape, scale_shape, axis, block):
    rng = np.random.default_rng(2)
    q = rng.integers(-128, 128, shape).astype(np.int8)
    s = rng.uniform(0.01, 0.1, scale_shape).astype(np.float32)
    z = rng.integers(-3, 4, scale_shape).astype(np.int8)
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs)
    g = helper.make_graph(
        [node],
        "dq",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(q, "q"), numpy_helper.from_array(s, "s"), numpy_helper.from_array(z, "z")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {})[0]
    np.testing.assert_array_equal(dequantize_linear(q, s, z, axis=axis, block=block), want)
