"""`edgekit run | eval | profile --engine onnxruntime`: an orin bundle off the Jetson, its ONNX graphs in ONNX
Runtime on this CPU (the reference the TensorRT engines are held to), each report billed by the Orin cost model
and labelled estimated; without the flag, the missing-TensorRT line says how to run it anyway (issue #30's seam).
A real orin build of a tiny random-weight model throughout; nothing here is measured on an Orin."""

from __future__ import annotations

import json
from importlib.resources import files
from types import SimpleNamespace

import pytest

from edgekit.bundle import load_bundle
from edgekit.cli.app import main
from edgekit.cli.errors import cli_message
from edgekit.errors import ConfigError
from edgekit.plugins import load_backend, resolve_engine
from edgekit.reporter import Reporter
from edgekit.target import RuntimeOptions
from edgekit.targets.orin.estimate import estimate_report
from edgekit.targets.orin.onnx_backend import OrinOnnxBackend
from edgekit.targets.orin.trt_import import tensorrt_available

SAMPLE = files("edgekit.models") / "samples" / "cr_chest"
NO_TRT = pytest.mark.skipif(tensorrt_available(), reason="TensorRT is importable here: the off-device line cannot show")


def test_run_writes_the_report_in_onnx_runtime_billed_by_the_estimate(tiny_orin_bundles, capsys):
    orin, _cpu = tiny_orin_bundles
    assert main(["run", str(orin), "-s", str(SAMPLE), "--engine", "onnxruntime", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == "orin" and report["engine"] == "onnxruntime"
    bundle = load_bundle(orin)
    reference = Reporter(bundle, backend=OrinOnnxBackend(bundle, intra_op_threads=1)).report(SAMPLE)
    assert report["text"] == reference.text and report["timings"]["new_tokens"] >= 1  # the graphs wrote it
    cost = report["cost"]
    expected = estimate_report(
        orin, "agx-orin-64", "MAXN", prompt_tokens=cost["prompt_tokens"], new_tokens=cost["new_tokens"]
    )
    assert report["energy_j"] == pytest.approx(expected.energy_j) and report["energy_j"] > 0
    assert report["energy_source"] == cost["figure_source"] == "estimated:orin-agx64-maxn"
    assert "not measured on a device" in cost["source"] and "in ONNX Runtime" in cost["source"]
    assert main(["run", str(orin), "-s", str(SAMPLE), "--engine", "onnxruntime"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("FINDINGS:")
    assert "on orin via onnxruntime (not tensorrt)" in err and "estimated:orin-agx64-maxn: " in err and " mJ" in err


def test_eval_scores_the_split_and_states_where_each_figure_comes_from(
    tiny_orin_bundles, synth_split3, tmp_path, capsys
):
    orin, _cpu = tiny_orin_bundles
    args = ["eval", str(orin), "--engine", "onnxruntime", "--data", str(synth_split3), "--no-video"]
    assert main([*args, "-o", str(tmp_path / "eval.json"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine"] == "onnxruntime" and summary["target"] == "orin"
    overall = summary["overall"]
    assert overall["n"] == 3 and overall["failed"] == 0
    assert 0.0 <= overall["finding_f1"]["value"] <= 1.0  # a random-weight model: any score, but a score
    records = json.loads((tmp_path / "eval.json").read_text())["records"]
    billed = overall["billed"]
    assert billed["figure_source"] == "estimated:orin-agx64-maxn" and "not measured" in billed["source"]
    assert billed["energy_j_per_report"] == pytest.approx(sum(r["energy_j"] for r in records) / 3)
    assert billed["latency_ms_per_report"] == pytest.approx(sum(r["cost"]["latency_ms"] for r in records) / 3)
    assert overall["emulated"] is None and overall["dss"] is None  # nothing emulated, no heads skipped
    assert main(args) == 0
    table = " ".join(capsys.readouterr().out.split())  # the note's line may wrap
    assert "on orin via onnxruntime (not tensorrt): synthetic test split, 3 studies" in table
    assert "estimated ms / mJ" in table  # the Orin's, per report, beside this machine's p50 ms
    assert "estimated ms / mJ: per report, estimated:orin-agx64-maxn (" in table and "not measured" in table


def test_profile_writes_the_ort_trace_and_a_billed_row(tiny_orin_bundles, tmp_path, capsys):
    orin, _cpu = tiny_orin_bundles
    out = tmp_path / "profile"
    assert main(["profile", str(orin), "--engine", "onnxruntime", "-s", str(SAMPLE), "-o", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["engine"] == "onnxruntime" and result["summary_title"].endswith("orin via onnxruntime (not tensorrt)")
    assert result["source"].startswith("ONNX Runtime profiler")
    rows = result["tables"]["kernel time by op type"]
    assert rows and all(r["ms"] >= 0 and r["calls"] >= 1 for r in rows)
    assert {r["graph"] for r in rows} <= {"vision_encoder", "embed_tokens", "decoder"}
    assert result["energy_source"] == "estimated:orin-agx64-maxn" and result["energy_j"] > 0
    assert result["summary"]["billed / report"].endswith("mJ (estimated:orin-agx64-maxn)")
    trace = json.loads((out / "trace.json").read_text())
    assert trace and json.loads((out / "profile.json").read_text())["engine"] == "onnxruntime"


def test_the_flag_checks_the_target_has_the_engine(tiny_orin_bundles, capsys):
    orin, cpu = tiny_orin_bundles
    assert main(["run", str(cpu), "-s", str(SAMPLE), "--engine", "onnxruntime", "--json"]) == 0  # cpu's own
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "onnxruntime" and report["energy_source"] is None  # nothing billed on cpu
    x1 = SimpleNamespace(target="x1", source="b-x1")
    with pytest.raises(ConfigError) as err:
        resolve_engine(x1, "onnxruntime")
    assert cli_message(str(err.value)) == "b-x1: --engine onnxruntime does not run x1 bundles (its engine: emulator)"
    assert resolve_engine(x1) == "emulator" and resolve_engine(load_bundle(orin)) == "tensorrt"
    assert main(["run", str(orin), "-s", str(SAMPLE), "--engine", "trt"]) == 2
    assert "'trt' is not one of 'default', 'onnxruntime'" in capsys.readouterr().err


def test_the_engine_option_bills_the_estimate_a_setting_names_and_refuses_a_conflict(tiny_orin_bundles):
    bundle = load_bundle(tiny_orin_bundles[0])
    options = RuntimeOptions(threads=1, engine="onnxruntime", settings={"estimate": "orin-nano-8:15W"})
    assert Reporter(bundle, runtime=options).report(SAMPLE).energy_source == "estimated:orin-nano8-15w"
    with pytest.raises(ConfigError, match="engine 'onnxruntime' and orin setting engine = 'tensorrt' disagree"):
        load_backend(bundle, RuntimeOptions(engine="onnxruntime", settings={"engine": "tensorrt"}))
    plain = Reporter(bundle, runtime=RuntimeOptions(threads=1, settings={"engine": "onnxruntime"}))
    assert plain.report(SAMPLE).energy_source is None  # the setting alone bills nothing, as before (the daemon's)


def test_help_shows_the_flag_and_its_choices(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    for command in ("run", "eval", "profile"):
        assert main([command, "--help"]) == 0
        text = capsys.readouterr().out
        assert "--engine" in text and "default|onnxruntime" in text.replace("'", "")
        assert f"edgekit {command} out/radreport-tiny-orin --engine onnxruntime" in text
