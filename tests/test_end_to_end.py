"""The main job, end to end on the embedded default model: build for cpu, write reports, evaluate, profile.

These run the real CLI entry point (`edgekit.cli.app.main`) on the committed weights and bundled samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekit.build import build, default_model_dir
from edgekit.bundle import load_bundle
from edgekit.cli.app import main
from edgekit.findings import Finding, parse_report

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "models" / "samples"


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "radreport-tiny-cpu"
    build("cpu", out, parity=False)
    return out


def _truth(sample: Path) -> set[tuple]:
    return {(f["type"], f["location"]) for f in json.loads((sample / "study.json").read_text())["findings"]}


def test_bundle_is_complete_and_verified(bundle_dir):
    b = load_bundle(bundle_dir)
    assert b.target == "cpu" and b.name == "radreport-tiny"
    m = b.manifest
    assert m.provenance["source_weights_sha256"]
    assert m.figures["size"]["bytes"] == sum(c.bytes for c in m.components.values())


@pytest.mark.parametrize("sample", ["ct_chest", "cr_chest", "us_cardiac", "us_cardiac/cine.mp4"])
def test_run_writes_a_report_that_names_the_true_findings(bundle_dir, sample, capsys):
    study = SAMPLES / sample
    meta_dir = study if study.is_dir() else study.parent
    rc = main(["run", str(bundle_dir), "--study", str(study), "--prompt", "Follow-up.", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["text"].startswith("FINDINGS:")
    got = {(f.type, f.location) for f in parse_report(report["text"]).findings}
    assert got == _truth(meta_dir), report["text"]
    assert report["study"].startswith("uid:")
    assert report["timings"]["new_tokens"] > 5


def test_sampling_is_reproducible_with_a_seed(bundle_dir, capsys):
    args = ["run", str(bundle_dir), "--study", str(SAMPLES / "cr_chest"), "--temperature", "1.0", "--json"]
    texts = []
    for seed in ("1", "1"):
        assert main(args + ["--seed", seed]) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[0] == texts[1]


def test_eval_on_a_small_split_scores_with_intervals(bundle_dir, tmp_path, capsys):
    from edgekit.models.synth import write_split

    data = write_split(tmp_path / "split", "test", 16).parent
    out = tmp_path / "result.json"
    assert main(["eval", str(bundle_dir), "--data", str(data), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    overall = summary["overall"]
    assert overall["n"] == 16 and overall["failed"] == 0
    lo, hi = overall["finding_f1"]["ci95"]
    assert lo <= overall["finding_f1"]["value"] <= hi
    assert overall["finding_f1"]["value"] >= 0.8
    assert 0 < overall["bleu4"]["value"] <= 100
    records = json.loads(out.read_text())["records"]
    assert len(records) == 16 + sum(1 for r in records if r["source"] == "video")


def test_eval_records_an_unreadable_study_and_goes_on(bundle_dir, tmp_path, capsys):
    from edgekit.models.synth import write_split

    data = write_split(tmp_path / "split", "test", 4).parent
    rows = [json.loads(x) for x in (data / "studies.jsonl").read_text().splitlines()]
    victim = data / rows[0]["path"]
    for f in victim.rglob("*.dcm") if victim.is_dir() else [victim]:
        f.write_bytes(b"not a dicom file")
    assert main(["eval", str(bundle_dir), "--data", str(data), "--no-video", "--json"]) == 0
    overall = json.loads(capsys.readouterr().out)["overall"]
    assert overall["failed"] == 1 and overall["n"] == 3


def test_profile_writes_a_trace_a_profiler_opens_and_a_plot(bundle_dir, tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", str(bundle_dir), "--study", str(SAMPLES / "cr_chest"), "-o", str(out), "--json"]) == 0
    trace = json.loads((out / "trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"]}
    assert len(pids) == 3
    assert any(e.get("cat") == "Node" for e in trace["traceEvents"])
    assert (out / "ops.png").read_bytes()[:4] == b"\x89PNG"
    result = json.loads(capsys.readouterr().out)
    assert result["ops"] and result["ops"][0]["ms"] > 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "{bundle}", "--study", "{tmp}/missing.dcm"], "missing.dcm"),
        (["run", "{bundle}", "--study", "{tmp}/notdicom.dcm"], "notdicom.dcm"),
        (["run", "{tmp}/nobundle", "--study", "{tmp}/notdicom.dcm"], "nobundle"),
        (["build", "--target", "cpu", "-o", "{tmp}/o", "{tmp}"], str(Path("{tmp}"))),
    ],
)
def test_bad_input_is_one_line_naming_the_file(bundle_dir, tmp_path, capsys, args, needle):
    (tmp_path / "notdicom.dcm").write_text("hello")
    fill = {"bundle": str(bundle_dir), "tmp": str(tmp_path)}
    rc = main([a.format(**fill) for a in args])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert needle.format(**fill) in err


def test_convert_writes_three_graphs(tmp_path, capsys):
    assert main(["convert", str(default_model_dir()), "-o", str(tmp_path), "--json"]) == 0
    graphs = {g["graph"] for g in json.loads(capsys.readouterr().out)}
    assert graphs == {"vision_encoder.onnx", "embed_tokens.onnx", "decoder_model_merged.onnx"}


def test_sample_ground_truth_is_consistent():
    for sample in ("ct_chest", "cr_chest", "us_cardiac"):
        meta = json.loads((SAMPLES / sample / "study.json").read_text())
        parsed = parse_report(meta["references"][0])
        assert {(f.type, f.location) for f in parsed.findings} == _truth(SAMPLES / sample)
        assert [Finding(**f).to_dict() for f in meta["findings"]] == meta["findings"]


def test_build_with_a_recipe_records_its_passes_and_still_reports(tmp_path, capsys):
    out = tmp_path / "int4"
    rc = main(["build", "--target", "cpu", "--recipe", "int4", "--no-parity", "-o", str(out), "--json"])
    assert rc == 0
    m = load_bundle(out).manifest
    recipe_steps = [s for s in m.provenance["passes"] if s["name"] == "recipe"]
    assert recipe_steps and recipe_steps[0]["passes"][0]["pass_name"] == "int4"
    logits = [e for e in m.figures["recipe"]["end_to_end_error"]["decoder_model_merged.onnx"] if e["name"] == "logits"]
    assert 0 < logits[0]["rel_l2"] < 0.2
    assert m.components["decoder"].bytes < 0.3 * (default_model_dir() / "model.safetensors").stat().st_size
    capsys.readouterr()
    assert main(["run", str(out), "--study", str(SAMPLES / "cr_chest"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].startswith("FINDINGS:")
