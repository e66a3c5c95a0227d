"""An Orin front before anyone holds an Orin: an orin bundle's graphs run in ONNX Runtime here
(`engine=onnxruntime`) and each report is billed by the Orin cost model for the tokens it used
(`estimate=DEVICE:MODE`), labelled estimated; `edgekit pareto --orin-estimate` grids over devices and power modes.
A real orin build of a tiny random-weight model throughout; nothing here is measured on an Orin."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

from edgekit.bundle import load_bundle
from edgekit.cli.app import main
from edgekit.errors import ConfigError
from edgekit.pareto import read_profile
from edgekit.reporter import Reporter
from edgekit.target import RuntimeOptions
from edgekit.targets.orin.estimate import estimate_report
from edgekit.targets.orin.onnx_backend import OrinOnnxBackend

SAMPLE = files("edgekit.models") / "samples" / "cr_chest"
ESTIMATE = {"engine": "onnxruntime", "estimate": "agx-orin-64:MAXN"}


def test_each_report_is_billed_by_the_estimate_for_its_own_tokens(tiny_orin_bundles):
    path, _cpu = tiny_orin_bundles
    bundle = load_bundle(path)
    reporter = Reporter(bundle, runtime=RuntimeOptions(threads=1, settings=ESTIMATE))
    assert isinstance(reporter.backend, OrinOnnxBackend)
    for prompt, cap in (("", 8), ("Cough and fever for three days.", 3)):
        report = reporter.report(SAMPLE, prompt, reporter.options(max_new_tokens=cap))
        cost = report.cost
        prompt_tokens = reporter.prompt_ids("CR", prompt).shape[1]
        chosen = report.timings["new_tokens"] + (report.stop_reason == "stop_token")  # the stop token cost a pass
        assert (cost["prompt_tokens"], cost["new_tokens"]) == (prompt_tokens, chosen)
        expected = estimate_report(path, "agx-orin-64", "MAXN", prompt_tokens=prompt_tokens, new_tokens=chosen)
        assert cost["latency_ms"] == pytest.approx(expected.latency_ms)
        assert report.energy_j == pytest.approx(expected.energy_j) and report.energy_j > 0
        assert report.energy_source == cost["figure_source"] == "estimated:orin-agx64-maxn"
        assert [p["phase"] for p in cost["breakdown"]] == ["vision", "prefill", "decode"]
        assert "not measured on a device" in cost["source"]
    plain = Reporter(bundle, backend=OrinOnnxBackend(bundle, intra_op_threads=1)).report(SAMPLE)
    assert plain.cost == {} and plain.energy_source is None
    assert plain.text == reporter.report(SAMPLE).text  # billing changes the figures, not the report


def test_lower_power_modes_are_not_faster_and_say_which_mode(tiny_orin_bundles):
    bundle = load_bundle(tiny_orin_bundles[0])
    costs = {}
    for mode in ("MAXN", "30W", "15W"):
        settings = {"engine": "onnxruntime", "estimate": f"agx64:{mode.lower()}"}  # labels and any case work
        costs[mode] = Reporter(bundle, runtime=RuntimeOptions(threads=1, settings=settings)).report(SAMPLE).cost
    assert costs["MAXN"]["latency_ms"] <= costs["30W"]["latency_ms"] <= costs["15W"]["latency_ms"]
    assert costs["15W"]["energy_j"] < costs["MAXN"]["energy_j"]
    assert [c["figure_source"] for c in costs.values()] == [
        "estimated:orin-agx64-maxn",
        "estimated:orin-agx64-30w",
        "estimated:orin-agx64-15w",
    ]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"engine": "onnxruntime", "estimate": "agx-orin-64:20W"}, "unknown Orin estimate 'agx-orin-64:20W'"),
        ({"engine": "onnxruntime", "estimate": "agx-orin-64"}, "unknown Orin estimate 'agx-orin-64' (DEVICE:MODE"),
        ({"engine": "onnxruntime", "estimate": "xavier:MAXN"}, "known: agx-orin-64:MAXN|50W|30W|15W, "),
        ({"estimate": "agx-orin-64:MAXN"}, "set engine=onnxruntime too"),
        ({"engine": "trt"}, "engine = 'trt' (expected tensorrt or onnxruntime)"),
        ({"engin": "onnxruntime"}, "unknown runtime setting(s) engin (known: builder_optimization_level,"),
        ({"engine": "onnxruntime", "workspace_mib": 64}, "workspace_mib: TensorRT build settings"),
    ],
)
def test_bad_settings_are_one_line_naming_the_bundle(tiny_orin_bundles, settings, message):
    bundle = load_bundle(tiny_orin_bundles[0])
    with pytest.raises(ConfigError) as err:
        Reporter(bundle, runtime=RuntimeOptions(settings=settings))
    line = str(err.value)
    assert "\n" not in line and line.startswith(str(bundle.source)) and message in line


def test_pareto_grids_over_orin_power_modes(tiny_orin_bundles, synth_split3, tmp_path, capsys):
    orin, cpu = tiny_orin_bundles
    out = tmp_path / "profile"
    args = ["pareto", str(orin), str(cpu), "-o", str(out), "--data", str(synth_split3), "--limit", "2", "--json"]
    assert main([*args, "--orin-estimate", "agx-orin-64:MAXN", "--orin-estimate", "AGX-ORIN-64:15w"]) == 0
    json.loads(capsys.readouterr().out)
    points = read_profile(out / "pareto.json").by_id()
    maxn = points["tiny-orin[orin_estimate=agx-orin-64:MAXN]"]
    low = points["tiny-orin[orin_estimate=agx-orin-64:15W]"]  # the mode spelled as the cost model spells it
    assert (maxn.energy_source, maxn.latency_source) == ("estimated:orin-agx64-maxn",) * 2
    assert (low.energy_source, low.latency_source) == ("estimated:orin-agx64-15w",) * 2
    assert low.latency_p50_ms >= maxn.latency_p50_ms and low.energy_j < maxn.energy_j
    assert maxn.f1 == low.f1 and maxn.count == 2  # the same graphs wrote the same reports
    assert points["tiny-cpu"].energy_source.startswith(("measured:", "estimated:cpu"))  # the knob is orin's only


def test_pareto_refuses_an_unknown_orin_mode_in_one_line(tiny_orin_bundles, synth_split3, tmp_path, capsys):
    orin, cpu = tiny_orin_bundles
    base = ["pareto", str(orin), "-o", str(tmp_path / "p"), "--data", str(synth_split3)]
    assert main([*base, "--orin-estimate", "agx-orin-64:MAXN", "--orin-estimate", "orin-nano-8:MAXN"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown Orin estimate 'orin-nano-8:MAXN'")
    assert "orin-nano-8:15W|7W" in err[0] and not (tmp_path / "p").exists()
    assert main(["pareto", str(cpu), "-o", str(tmp_path / "q"), "--orin-estimate", "agx-orin-64:MAXN"]) == 2
    assert "applies to orin bundles, and none of these is one" in capsys.readouterr().err
    batch = [*base, "--orin-estimate", "agx-orin-64:MAXN", "--max-batch", "1", "--max-batch", "8"]
    assert main(batch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bills each report as if alone" in err[0] and not (tmp_path / "p").exists()


def test_eval_refuses_reports_in_flight_where_the_estimate_bills_each_alone(tiny_orin_bundles, synth_split3, capsys):
    """Off the Jetson an orin bundle is billed by the Orin estimate, one report as if alone: `eval --concurrency`
    above 1 would bill reports decoded together wrong, so it is refused in one line naming the bundle."""
    orin, _ = tiny_orin_bundles
    args = ["eval", str(orin), "--engine", "onnxruntime", "--data", str(synth_split3), "--no-video"]
    assert main([*args, "--concurrency", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(orin) in err[0] and "bills each report as if it ran alone" in err[0]
    assert main([*args, "--limit", "1", "--concurrency", "1", "--json"]) == 0  # one at a time it is billed right
