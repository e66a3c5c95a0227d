"""`write_split` and `edgekit data synth`: what is on disk matches studies.jsonl and the generator."""

import json
import time

import numpy as np
import pydicom
import pytest
from typer.testing import CliRunner

from edgekit.cli.data_cmd import app
from edgekit.errors import ConfigError
from edgekit.findings import Finding
from edgekit.models.synth import generate_study, write_split
from edgekit.models.synth.video_writer import read_mp4_gray


def _records(index):
    return [json.loads(line) for line in index.read_text().splitlines()]


def test_split_on_disk_matches_index_and_generator(tmp_path):
    index = write_split(tmp_path / "d", "val", 8)
    assert index == tmp_path / "d" / "studies.jsonl"
    recs = _records(index)
    assert [r["id"] for r in recs] == [f"val-{i:05d}" for i in range(8)]
    for i, r in enumerate(recs):
        s = generate_study(i, "val")
        assert r["split"] == "val" and r["modality"] == s.modality
        assert [Finding(**f) for f in r["findings"]] == s.findings
        assert r["negatives"] == s.negatives and r["references"] == s.references
        assert r["indication"] == s.indication
        path = index.parent / r["path"]
        files = sorted(path.glob("*.dcm")) if path.is_dir() else [path]
        assert len(files) == s.num_frames if s.modality in ("CT", "MR") else len(files) == 1
        decoded = np.stack([pydicom.dcmread(p).pixel_array for p in files]).reshape(s.stored.shape)
        if r["transfer_syntax"] != pydicom.uid.JPEGBaseline8Bit:
            assert np.array_equal(decoded, s.stored)
        if s.modality == "US":
            assert read_mp4_gray(index.parent / r["video_path"]).shape[0] == s.num_frames
        else:
            assert "video_path" not in r


def test_rewriting_same_split_replaces_and_other_split_refused(tmp_path):
    out = tmp_path / "d"
    write_split(out, "test", 6)
    index = write_split(out, "test", 3)  # shrinking removes the studies it no longer lists
    assert len(_records(index)) == 3 and not (out / "test-00004").exists()
    with pytest.raises(ConfigError, match="split"):
        write_split(out, "train", 2)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError):
        write_split(tmp_path / "other", "test", 1)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_writing_is_fast_enough_for_the_test_split(tmp_path):
    """The 240-study test split must take < 60 s on one core: 24 studies get a tenth of that, with 2x slack for
    a shared machine."""
    t0 = time.perf_counter()
    write_split(tmp_path / "d", "test", 24)
    assert time.perf_counter() - t0 < 12.0


def test_cli_json_summary(tmp_path):
    out = tmp_path / "cli"
    res = CliRunner().invoke(app, ["synth", "-o", str(out), "--count", "8", "--split", "sample", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["studies"] == 8 and summary["split"] == "sample"
    assert summary["by_kind"] == {"cr_chest": 2, "ct_chest": 2, "mr_brain": 2, "us_cardiac": 2}
    assert sum(summary["by_transfer_syntax"].values()) == 8
    on_disk = sum(1 for p in out.rglob("*") if p.is_file())
    assert summary["files"] == on_disk and summary["seconds"] > 0


def test_cli_errors_and_help(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["synth", "-o", str(tmp_path / "x"), "--split", "holdout"])
    assert res.exit_code != 0 and "holdout" in res.output
    res = runner.invoke(app, ["synth", "--help"])
    assert res.exit_code == 0 and "edgekit data synth" in res.output


def test_no_patient_data_in_index(tmp_path):
    index = write_split(tmp_path / "d", "test", 4)
    text = index.read_text()
    for i in range(4):
        s = generate_study(i, "test")
        for key in ("PatientName", "PatientID", "PatientBirthDate", "StudyDate"):
            assert s.patient[key] not in text
        assert s.study_uid not in text
