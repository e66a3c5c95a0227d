"""The main job, end to end on the embedded default model: build for cpu, write reports, evaluate, profile.

These run the real CLI entry point (`edgekit.cli.app.main`) on the committed weights and bundled samples.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edgekit import names
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


def _truth(kind: str) -> set[tuple]:
    return {(f["type"], f["location"]) for f in json.loads((SAMPLES / f"{kind}.json").read_text())["findings"]}


def test_bundle_is_complete_and_verified(bundle_dir):
    b = load_bundle(bundle_dir)
    assert b.target == "cpu" and b.name == "radreport-tiny"
    m = b.manifest
    assert m.provenance["source_weights_sha256"]
    assert m.figures["size"]["bytes"] == sum(c.bytes for c in m.components.values())


@pytest.mark.parametrize("sample", ["ct_chest", "cr_chest", "us_cardiac", "us_cardiac/cine.mp4"])
def test_run_writes_a_report_that_names_the_true_findings(bundle_dir, sample, capsys):
    study = SAMPLES / sample
    rc = main(["run", str(bundle_dir), "--study", str(study), "--prompt", "Follow-up.", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["text"].startswith("FINDINGS:")
    got = {(f.type, f.location) for f in parse_report(report["text"]).findings}
    assert got == _truth(sample.split("/")[0]), report["text"]
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


def test_eval_with_reports_in_flight_gives_the_same_records_in_order(bundle_dir, tmp_path, capsys):
    """`--concurrency 3`: three reports at a time, decoded together; an unreadable study is still one failure in
    its place, and the greedy reports are the ones written one at a time."""
    from edgekit.models.synth import write_split

    data = write_split(tmp_path / "split", "test", 5).parent
    rows = [json.loads(x) for x in (data / "studies.jsonl").read_text().splitlines()]
    victim = data / rows[1]["path"]
    for f in victim.rglob("*.dcm") if victim.is_dir() else [victim]:
        f.write_bytes(b"not a dicom file")
    records = {}
    for n in ("1", "3"):
        out = tmp_path / f"c{n}.json"
        assert (
            main(["eval", str(bundle_dir), "--data", str(data), "--no-video", "--concurrency", n, "-o", str(out)]) == 0
        )
        assert ("3 in flight" in capsys.readouterr().out) == (n == "3")
        result = json.loads(out.read_text())
        assert result["rows_max"] == (3 if n == "3" else 8)  # its engine took a row for each report in flight
        records[n] = result["records"]
    assert [r["id"] for r in records["3"]] == [r["id"] for r in records["1"]] == [r["id"] for r in rows]
    assert [r["error"] is not None for r in records["3"]] == [False, True, False, False, False]
    assert [r.get("text") for r in records["3"]] == [r.get("text") for r in records["1"]]


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
        meta = json.loads((SAMPLES / f"{sample}.json").read_text())
        parsed = parse_report(meta["references"][0])
        assert {(f.type, f.location) for f in parsed.findings} == _truth(sample)
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


# --- one-line errors, warnings, limits (issue items 3, 5, 6, 11) --------------------------------------------------


def _only_dicom_copy(sample: Path, dest: Path) -> Path:
    """The sample's DICOM files, plus a stray text file."""
    dest.mkdir()
    for f in sample.glob("*.dcm"):
        (dest / f.name).write_bytes(f.read_bytes())
    (dest / "notes.txt").write_text("a stray file a scanner export left behind")
    return dest


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("{not json", "line 2: not a JSON object"),
        ("[1, 2]", "line 2: not a JSON object"),
        ('{"id": "x"}', "line 2: study record without"),
    ],
)
def test_a_malformed_studies_jsonl_is_one_line_naming_the_line(bundle_dir, tmp_path, capsys, bad, needle):
    from edgekit.models.synth import write_split

    data = write_split(tmp_path / "split", "test", 2).parent
    lines = (data / "studies.jsonl").read_text().splitlines()
    (data / "studies.jsonl").write_text("\n".join([lines[0], bad, lines[1]]) + "\n")
    assert main(["eval", str(bundle_dir), "--data", str(data), "--no-video"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(data / "studies.jsonl") in err and needle in err
    assert main(["eval", str(bundle_dir), "--data", str(data), "--no-video", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["file"] == str(data / "studies.jsonl") and needle in error["message"]


def test_run_shows_ingest_warnings_and_lists_them_in_json(bundle_dir, tmp_path, capsys):
    study = _only_dicom_copy(SAMPLES / "ct_chest", tmp_path / "ct")
    assert main(["run", str(bundle_dir), "--study", str(study)]) == 0
    err_lines = capsys.readouterr().err.splitlines()
    assert "warning: skipped notes.txt: not a DICOM file" in err_lines
    assert main(["run", str(bundle_dir), "--study", str(study), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["warnings"] == ["skipped notes.txt: not a DICOM file"]
    assert "warning: skipped notes.txt" in err


def test_eval_counts_the_studies_that_came_with_warnings(bundle_dir, tmp_path, capsys):
    from edgekit.models.synth import write_split

    data = write_split(tmp_path / "split", "test", 3).parent
    rows = [json.loads(x) for x in (data / "studies.jsonl").read_text().splitlines()]
    folder = next(data / r["path"] for r in rows if (data / r["path"]).is_dir())
    (folder / "notes.txt").write_text("stray")
    out = tmp_path / "result.json"
    assert main(["eval", str(bundle_dir), "--data", str(data), "--no-video", "-o", str(out), "--json"]) == 0
    stdout, err = capsys.readouterr()
    assert json.loads(stdout)["studies_with_warnings"] == 1
    assert "1 of 3 studies came with ingest warnings" in err
    warned = [r for r in json.loads(out.read_text())["records"] if r.get("warnings")]
    assert len(warned) == 1 and "notes.txt" in warned[0]["warnings"][0]


def test_a_prompt_longer_than_the_context_is_refused_fast(bundle_dir, capsys):
    import time

    args = ["run", str(bundle_dir), "--study", str(SAMPLES / "cr_chest"), "--prompt", "x" * 20_000]
    t0 = time.perf_counter()
    assert main(args) == 2
    assert time.perf_counter() - t0 < 5.0
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "prompt is" in err, err
    assert main([*args, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "prompt_too_long"


def test_build_without_torch_prints_no_parity_step(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as without the train extra
    assert main(["build", "--target", "cpu", "-o", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "parity: ONNX Runtime against the PyTorch reference" not in err
    assert "parity: not measured" in err
    assert load_bundle(tmp_path / "b").manifest.figures["parity"]["measured"] is False


def test_x1_profile_says_where_head_importance_came_from_and_help_names_its_plot(tmp_path, capsys, monkeypatch):
    bundle = tmp_path / "x1"
    build("x1", bundle, parity=False)  # the default weights carry their learned head gates
    assert load_bundle(bundle).manifest.components[names.HEAD_IMPORTANCE].path == names.HEAD_IMPORTANCE_FILE
    ungated = tmp_path / "ungated"
    shutil.copytree(default_model_dir(), ungated)
    (ungated / names.HEAD_IMPORTANCE_FILE).unlink()
    build("x1", tmp_path / "x1-ungated", model_dir=ungated, parity=False)
    summaries = {}
    for b in (bundle, tmp_path / "x1-ungated"):
        out = tmp_path / f"prof-{b.name}"
        assert main(["profile", str(b), "--study", str(SAMPLES / "cr_chest"), "-o", str(out), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        summaries[b.name] = result["summary"]["DSS"]
    assert summaries["x1"].startswith("on (head importance from the bundle), skip rate ")
    assert summaries["x1-ungated"].startswith("on (uniform head importance: the bundle has none), skip rate ")
    plot = Path(result["plot"])
    assert plot.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["profile", "--help"]) == 0
    assert plot.name in capsys.readouterr().out
