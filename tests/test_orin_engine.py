"""The device side of orin: what runs without TensorRT runs here (profile bounds, the refusals before any GPU
work, `edgekit engine build --dry-run` and `check --onnxrt`, the one-line error when TensorRT is missing); what
needs TensorRT and a Jetson is written as tests that skip here with `TRT_MISSING`."""

from __future__ import annotations

import json
from importlib.resources import files

import numpy as np
import pytest

from edgekit import names
from edgekit.build import build
from edgekit.bundle import load_bundle
from edgekit.cli.app import main
from edgekit.errors import ConfigError
from edgekit.plugins import load_backend
from edgekit.targets.orin import OFF_DEVICE_HINT, TRT_MISSING
from edgekit.targets.orin.onnx_backend import OrinOnnxBackend
from edgekit.targets.orin.plan import with_overrides
from edgekit.targets.orin.profiles import ProfileError, select_profile
from edgekit.targets.orin.trt_import import tensorrt_available

SAMPLE = files("edgekit.models") / "samples" / "ct_chest"
HAS_TRT = tensorrt_available()
needs_tensorrt = pytest.mark.skipif(not HAS_TRT, reason=TRT_MISSING)


@pytest.fixture(scope="module")
def orin_bundle(tmp_path_factory):
    return load_bundle(build("orin", tmp_path_factory.mktemp("orin-engine") / "orin", parity=False).bundle)


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory):
    return build("cpu", tmp_path_factory.mktemp("orin-engine-cpu") / "cpu", parity=False).bundle


# ---------------------------------------------------------------------------------------------------------------
# no TensorRT needed
# ---------------------------------------------------------------------------------------------------------------
def test_a_frame_skipped_video_fits_the_vision_profile(orin_bundle, tmp_path):
    """Frame skipping (the daemon's `video_max_frames` below the model's 8) hands the encoder fewer frames: the
    vision profile spans 1 .. num_frames, so the engine takes it; more frames than the model's stay refused."""
    from edgekit.ingest import IngestLimits, load_study
    from edgekit.reporter import Reporter

    from ingest_factory import write_mp4

    (vision,) = orin_bundle.manifest.runtime["profiles"]["vision_encoder"]
    frames = vision["shapes"][names.PIXEL_VALUES]
    assert (frames["min"][1], frames["opt"][1], frames["max"][1]) == (1, 8, 8)
    study = load_study(write_mp4(tmp_path / "cine.mp4", frames=40), limits=IngestLimits(video_max_frames=4))
    reporter = Reporter(orin_bundle, backend=OrinOnnxBackend(orin_bundle, intra_op_threads=1))
    report = reporter.report(study, "", reporter.options(max_new_tokens=4))
    assert report.frames["model_frames"] == 4 and report.timings["new_tokens"] >= 1
    with pytest.raises(ProfileError, match="outside"):
        reporter.backend.encode_images(np.zeros((1, 9, 1, 64, 64), np.float32))


def test_requests_beyond_the_profiles_are_refused_before_any_work(orin_bundle):
    profiles = orin_bundle.manifest.runtime["profiles"]["decoder"]
    kv = {names.past_key(0): (1, 2, 0, 32)}
    assert select_profile(profiles, {names.INPUTS_EMBEDS: (1, 40, 192), **kv}, "decoder") == 0  # prefill
    assert select_profile(profiles, {names.INPUTS_EMBEDS: (1, 1, 192), names.past_key(0): (1, 2, 40, 32)}, "decoder")
    backend = OrinOnnxBackend(orin_bundle, intra_op_threads=1)
    x = np.zeros((1, 300, 192), np.float32)
    mask, pos = np.ones((1, 300), np.int64), np.arange(300, dtype=np.int64)[None]
    with pytest.raises(ProfileError) as err:
        backend.decode(x, mask, pos)
    line = str(err.value)
    assert "\n" not in line and line.startswith(str(orin_bundle.source))
    assert "a prompt of 300 positions (image and text) is longer than the engine's maximum of 256" in line
    with pytest.raises(ProfileError, match=r"input pixel_values has size 9 on axis 0, outside .*\[1, 8\]"):
        backend.encode_images(np.zeros((9, 8, 1, 64, 64), np.float32))
    past = [(np.zeros((1, 2, 256, 32), np.float32),) * 2] * backend.num_layers
    with pytest.raises(ProfileError, match="outside the engine's profile"):  # a KV cache already full
        backend.decode(np.zeros((1, 1, 192), np.float32), np.ones((1, 257), np.int64), np.array([[256]]), past)


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is importable here: the missing-TensorRT line cannot show")
def test_without_tensorrt_the_run_side_fails_in_one_line(orin_bundle, capsys, tmp_path):
    from edgekit.target import RuntimeOptions
    from edgekit.targets.orin.trt_import import DeviceRuntimeMissing

    with pytest.raises(DeviceRuntimeMissing) as err:
        load_backend(orin_bundle)
    assert TRT_MISSING == "TensorRT not importable (needs JetPack 6.x / TensorRT ≥ 10.3)"
    assert str(err.value) == f"{orin_bundle.source}: {TRT_MISSING}; {OFF_DEVICE_HINT}"  # and how to run it anyway
    with pytest.raises(DeviceRuntimeMissing, match="TensorRT not importable"):  # the first start builds nothing
        load_backend(orin_bundle, RuntimeOptions(state_dir=tmp_path / "state", settings={"engine": "tensorrt"}))
    assert not (tmp_path / "state").exists()
    assert main(["run", str(orin_bundle.source), "--study", str(SAMPLE)]) == 2
    err_line = capsys.readouterr().err.strip()
    assert err_line.startswith(f"error: {orin_bundle.source}: {TRT_MISSING}; ") and "--engine onnxruntime" in err_line
    assert main(["engine", "build", str(orin_bundle.source), "--json"]) == 2
    out, err_text = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == "device_runtime_missing" and err_text.count("\n") == 1


def test_bad_input_is_refused_in_one_line_before_gpu_work(orin_bundle, cpu_bundle, capsys):
    assert main(["engine", "build", str(cpu_bundle), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {cpu_bundle}: this bundle is for target 'cpu', not orin: build one with " + (
        "`edgekit build --target orin`"
    )
    assert main(["engine", "check", str(cpu_bundle), "--onnxrt"]) == 2
    assert "for target 'cpu'" in capsys.readouterr().err
    assert main(["engine", "build", str(orin_bundle.source), "--dry-run", "--dla", "decoder"]) == 2
    assert "devices.decoder is dla but no dla_core is set" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot be overridden: profiles"):
        with_overrides(orin_bundle.manifest.runtime, {"profiles": {}}, "b")


def test_dry_run_shows_the_plan_and_the_dla_check(orin_bundle, capsys):
    assert main(["engine", "build", str(orin_bundle.source), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["profiles"] == {
        "vision_encoder": ["default"],
        "embed_tokens": ["default"],
        "decoder": ["prefill", "decode"],
    }
    assert plan["capability"]["decoder_model_merged.onnx"]["findings"] == 0
    if not HAS_TRT:
        assert plan["device"]["tensorrt"] == TRT_MISSING
    args = ["engine", "build", str(orin_bundle.source), "--dry-run", "--dla", "vision_encoder", "--dla-core", "0"]
    assert main([*args, "--json"]) == 0
    dla = json.loads(capsys.readouterr().out)
    vision = dla["capability"]["vision_encoder.onnx"]
    import onnx

    graph = onnx.load(str(orin_bundle.component(names.VISION))).graph
    shape_ops = sum(1 for n in graph.node if n.op_type in ("Shape", "Constant"))
    assert vision["findings"] == vision["nodes"] - shape_ops  # batch 1..8 is not static: the GPU runs it all
    assert dla["plan"]["devices"]["vision_encoder"] == "dla" and dla["plan"]["dla_core"] == 0


def test_engine_check_onnxrt_passes_and_gates_on_quality(orin_bundle, tmp_path, capsys):
    from edgekit.models.synth.splits import write_split

    split = tmp_path / "test"
    write_split(split, "test", 3)
    assert main(["engine", "check", str(orin_bundle.source), "--onnxrt", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["executor"] == "onnxrt"
    assert set(result["numerics"]["cases"]) == {"vision_encoder", "embed_tokens", "decoder:prefill", "decoder:decode"}
    args = ["engine", "check", str(orin_bundle.source), "--onnxrt", "--eval", str(split)]
    assert main([*args, "--floor", "0.5"]) == 0
    assert "passed" in capsys.readouterr().err
    from edgekit.targets.orin.engine_check import check_bundle

    failed = check_bundle(orin_bundle, executor="onnxrt", eval_data=split, floor=1.01)  # no F1 reaches it
    assert not failed["passed"] and failed["failures"][0].endswith("< floor 1.01")
    assert failed["quality"]["n"] == 3


# ---------------------------------------------------------------------------------------------------------------
# TensorRT on a Jetson: skipped here
# ---------------------------------------------------------------------------------------------------------------
@needs_tensorrt
def test_engines_build_cache_and_pass_the_gate(orin_bundle, tmp_path):
    from edgekit.targets.orin.engine_build import build_engines
    from edgekit.targets.orin.engine_check import check_bundle

    meta = build_engines(orin_bundle, state=str(tmp_path))
    assert set(meta["engines"]) == set(names.GRAPH_ROLES) and meta["peak_host_rss_mib"] > 0
    again = build_engines(orin_bundle, state=str(tmp_path))
    assert again["up_to_date"] is True
    result = check_bundle(orin_bundle, state=str(tmp_path))
    assert result["passed"], result["failures"]


@needs_tensorrt
def test_the_tensorrt_backend_writes_the_same_report_as_onnx_runtime(orin_bundle, tmp_path, monkeypatch):
    from edgekit.reporter import Reporter
    from edgekit.targets.orin.engine_build import build_engines

    monkeypatch.setenv("EDGEKIT_STATE_DIR", str(tmp_path))
    build_engines(orin_bundle)
    trt_report = Reporter(orin_bundle).report(SAMPLE, "Cough.")
    ort_report = Reporter(orin_bundle, backend=OrinOnnxBackend(orin_bundle)).report(SAMPLE, "Cough.")
    assert trt_report.text == ort_report.text


@needs_tensorrt
def test_the_first_load_on_a_jetson_builds_the_engines_then_serves(orin_bundle, tmp_path):
    """edgekitd's first start: no `edgekit engine build` beforehand; the second load finds them current."""
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    options = RuntimeOptions(state_dir=tmp_path)
    first = Reporter(orin_bundle, runtime=options).report(SAMPLE, "Cough.")
    (record,) = tmp_path.glob("engines/*/*/engines.json")
    built = record.stat().st_mtime_ns
    assert Reporter(orin_bundle, runtime=options).report(SAMPLE, "Cough.").text == first.text
    assert record.stat().st_mtime_ns == built
