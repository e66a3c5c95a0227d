"""`edgekit build --target orin` for the default model and every bundled recipe: what TensorRT would be handed is
real ONNX that runs here in ONNX Runtime, strongly typed FP16 with INT4 as symmetric blocked DequantizeLinear,
clean under the TensorRT 10.3 capability check, with profiles, a plan and parity references in the bundle.
No TensorRT runs in this file (see test_orin_engine.py for what needs it)."""

from __future__ import annotations

import json
from importlib.resources import files

import numpy as np
import onnx_ir as ir
import pytest

from edgekit import names
from edgekit.build import build
from edgekit.bundle import load_bundle
from edgekit.plugins import get_model_family
from edgekit.reporter import Reporter
from edgekit.targets.orin.build import CAPABILITY_ROLE, REFERENCE_ROLE
from edgekit.targets.orin.capability import check_file
from edgekit.targets.orin.engine_check import check_bundle
from edgekit.targets.orin.onnx_backend import OrinOnnxBackend

RECIPES = get_model_family().recipe_names()
SAMPLE = files("edgekit.models") / "samples" / "cr_chest"
F16, F32 = ir.DataType.FLOAT16, ir.DataType.FLOAT


@pytest.fixture(scope="module")
def default_bundle(tmp_path_factory):
    return load_bundle(build("orin", tmp_path_factory.mktemp("orin") / "b", parity=False).bundle)


def _weight_gemms(path):
    """(MatMul/Conv node, weight producer or initializer) for every GEMM with a constant weight."""
    out = []
    for node in ir.load(path).graph:
        if node.op_type not in ("MatMul", "Conv"):
            continue
        w = node.inputs[1]
        p = w.producer()
        if w.is_initializer() or (p is not None and p.op_type == "DequantizeLinear"):
            out.append((node, w, p))
    return out


def _check_strongly_typed(bundle):
    for role in names.GRAPH_ROLES:
        path = bundle.component(role)
        gemms = _weight_gemms(path)
        assert gemms or role == names.EMBED, role
        for node, w, dq in gemms:
            assert node.inputs[0].dtype == F16 and node.outputs[0].dtype == F16, node.name
            if dq is not None:  # INT4/INT8 weight-only: a constant 2-D weight, symmetric, FP16 scale
                q, scale = dq.inputs[0], dq.inputs[1]
                assert len(dq.inputs) == 2 and q.is_initializer() and len(q.shape) == 2, dq.name
                assert scale.dtype == F16 and dq.outputs[0].dtype == F16
                if q.dtype == ir.DataType.INT4:
                    k, n = q.shape
                    block = dq.attributes["block_size"].as_int()
                    assert dq.attributes["axis"].as_int() == 0 and tuple(scale.shape) == (k // block, n)
                else:  # INT8: per output channel (TensorRT blocks INT4 only)
                    assert q.dtype == ir.DataType.INT8 and tuple(scale.shape) == (q.shape[1],)
            else:
                assert w.dtype == F16
        for node in ir.load(path).graph:  # the delicate parts stay FP32
            if node.op_type in ("LayerNormalization", "Softmax", "ReduceMean"):
                assert node.inputs[0].dtype == F32, node.name
    graph_io = ir.load(bundle.component(names.DECODER_ROLE)).graph
    assert {v.dtype for v in graph_io.outputs} == {F32}  # logits and the KV cache


def test_default_build_is_trt_ready_and_matches_fp32(default_bundle):
    b = default_bundle
    m = b.manifest
    assert m.target == "orin" and {REFERENCE_ROLE, CAPABILITY_ROLE} <= set(m.components)
    _check_strongly_typed(b)
    cap = m.figures["orin_capability"]
    assert cap["tensorrt"] == "10.3" and cap["supported_nodes"] == cap["nodes"] > 400
    assert "96e781103c" in cap["source"]
    parity = m.figures["orin_parity"]["vs_fp32_export"]
    assert set(parity) == {"vision_encoder", "embed_tokens", "decoder:prefill", "decoder:decode"}
    assert all(c["rel_l2"] < 2e-3 for c in parity.values()), parity  # FP16 GEMMs only
    assert parity["decoder:decode"]["logits_top1"] == 1.0
    for role in names.GRAPH_ROLES:  # what the bundle ships is clean for TensorRT 10.3
        assert check_file(b.component(role)).findings == []


def test_plan_and_profiles_are_in_the_manifest(default_bundle):
    rt = default_bundle.manifest.runtime
    assert rt["strongly_typed"] and rt["tensorrt_min"] == "10.3" and rt["builder_optimization_level"] == 3
    assert rt["devices"] == {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}
    limits = rt["limits"]
    assert limits["max_positions"] == 256 and limits["image_tokens"] == 16 and limits["frames"] == 8
    vision = rt["profiles"]["vision_encoder"][0]["shapes"]["pixel_values"]
    # a static image; 1 .. 8 frames (frame skipping hands the encoder fewer), tuned for the model's 8
    # the engine encodes the images of the requests it admits together: up to its 8 rows
    assert vision == {"min": [1, 1, 1, 64, 64], "opt": [1, 8, 1, 64, 64], "max": [8, 8, 1, 64, 64]}
    assert rt["max_batch"] == limits["max_batch"] == 8  # the engine's default max_batch
    prefill, decode = rt["profiles"]["decoder"]
    assert (prefill["name"], decode["name"]) == ("prefill", "decode")
    # one prompt per prefill call (the engine prefills one request at a time): batch 1 only
    assert prefill["shapes"]["inputs_embeds"] == {"min": [1, 1, 192], "opt": [1, 32, 192], "max": [1, 256, 192]}
    assert prefill["shapes"]["past_key_values.0.key"]["max"] == [1, 2, 0, 32]
    # one decode step for every decoding row: batch 1 .. 8, tuned at 4
    assert decode["shapes"]["inputs_embeds"] == {"min": [1, 1, 192], "opt": [4, 1, 192], "max": [8, 1, 192]}
    assert decode["shapes"]["past_key_values.3.value"]["max"] == [8, 2, 255, 32]
    assert decode["shapes"]["attention_mask"]["max"] == [8, 256]
    for prof in (prefill, decode):
        for s in prof["shapes"].values():
            assert all(lo <= o <= hi for lo, o, hi in zip(s["min"], s["opt"], s["max"]))


def test_the_graphs_report_in_onnx_runtime_and_match_their_references(default_bundle, tmp_path):
    b = default_bundle
    report = Reporter(b, backend=OrinOnnxBackend(b, intra_op_threads=1)).report(SAMPLE, "Cough.")
    assert report.text and report.target == "orin"
    result = check_bundle(b, executor="onnxrt")
    assert result["passed"] and result["numerics"]["cases"]["decoder:decode"]["rel_l2"] == 0.0
    cap = json.loads(b.component(CAPABILITY_ROLE).read_text())
    assert cap["table_source"].startswith("https://github.com/onnx/onnx-tensorrt/blob/96e78110")
    assert cap["dla"]["vision_encoder"]["static_profile"] is False  # batch 1..8: the DLA would need it static


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_builds_for_orin(recipe, tmp_path):
    res = build("orin", tmp_path / recipe, parity=False, recipe=recipe)
    b = load_bundle(res.bundle)
    assert [s["name"] for s in res.steps] == ["export", "recipe", "orin_prepare"]
    for rep in res.steps[1]["passes"]:
        if "format" in rep["config"]:  # filled from the orin plug-in's formats; the deprecated target left unset
            assert rep["config"]["format"] == "qdq-blocked" and rep["config"]["target"] is None, rep["name"]
    _check_strongly_typed(b)
    figures = b.manifest.figures
    assert figures["orin_capability"]["supported_nodes"] == figures["orin_capability"]["nodes"]
    parity = figures["orin_parity"][f"vs_recipe_{recipe}"]  # what the orin preparation alone changed
    assert all(c["rel_l2"] < 0.01 for c in parity.values()), parity
    assert parity["decoder:decode"]["logits_top1"] == 1.0
    cap = json.loads(b.component(CAPABILITY_ROLE).read_text())
    fixes = {f["fix"] for r in cap["before_fixes"] for f in r["findings"]}
    if recipe in ("int4", "int4-awq", "int4-heads38", "int4-sparse24"):
        # INT4 embedding/patch/position tables feed no GEMM; the 8-bit LM head is blocked INT8
        assert fixes == {"fold-dequantize", "per-channel-int8"}
    elif recipe == "int8":
        assert fixes == {"per-channel-int8"}
    else:
        assert fixes == set()
    assert b.manifest.runtime["sparse_weights"] is (recipe == "int4-sparse24")
    if recipe == "int4-sparse24":
        decoder = next(c for c in res.steps[-1]["changes"] if c["graph"] == names.DECODER)
        assert decoder["sparse_2_4_weights"] >= 28  # the 2:4 pattern survives INT4 and the fixes
    backend = OrinOnnxBackend(b, intra_op_threads=1)
    report = Reporter(b, backend=backend).report(SAMPLE)
    assert report.text
    logits, _ = backend.decode(*_one_step(backend))
    assert np.isfinite(logits).all()


def _one_step(backend):
    x = backend.embed(np.array([[1, 5, 7]], np.int64))
    return x, np.ones((1, 3), np.int64), np.arange(3, dtype=np.int64)[None], None


def test_build_help_names_every_target_from_the_plugin_table(capsys, monkeypatch):
    from edgekit.cli.app import main
    from edgekit.plugins import target_names

    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["build", "--help"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "--target" in x)
    assert "orin" in target_names() and f"One of: {', '.join(target_names())}." in line
