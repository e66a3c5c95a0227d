"""The committed sample studies: small, decodable, and what the generator makes for them."""

import json
from pathlib import Path

import numpy as np
import pydicom

from edgekit.findings import Finding
from edgekit.models.synth import generate_study
from edgekit.models.synth.samples import SAMPLES_DIR, ground_truth_path, pick_samples
from edgekit.models.synth.video_writer import read_mp4_gray


def test_samples_present_small_and_true_to_the_generator():
    assert SAMPLES_DIR == Path(__file__).resolve().parent.parent / "models" / "samples"
    total = sum(p.stat().st_size for p in SAMPLES_DIR.rglob("*") if p.is_file())
    assert total < 1.5e6
    picked = pick_samples()
    assert set(picked) == {"ct_chest", "cr_chest", "us_cardiac"}
    for kind, study in picked.items():
        rec = json.loads(ground_truth_path(kind).read_text())
        assert rec["id"] == study.id and rec["split"] == "sample"
        index = int(rec["id"].split("-")[1])
        s = generate_study(index, "sample")
        assert [Finding(**f) for f in rec["findings"]] == s.findings and rec["negatives"] == s.negatives
        path = SAMPLES_DIR / rec["path"]
        files = sorted(path.glob("*.dcm")) if path.is_dir() else [path]
        decoded = np.stack([pydicom.dcmread(p).pixel_array for p in files]).reshape(s.stored.shape)
        err = np.abs(decoded.astype(np.int32) - s.stored.astype(np.int32))
        assert err.mean() < 3.0 if s.modality == "US" else err.max() == 0
        if s.modality == "US":
            assert read_mp4_gray(SAMPLES_DIR / rec["video_path"]).shape == s.stored.shape


def test_sample_folders_hold_only_the_study_so_loading_them_warns_about_nothing():
    from edgekit.ingest.load import load_study

    assert not list(SAMPLES_DIR.glob("*/*.json"))  # the ground truth lives beside each folder, not in it
    for kind in ("ct_chest", "cr_chest"):
        assert load_study(SAMPLES_DIR / kind).warnings == [], kind
    # the cine folder holds the same loop twice, as DICOM and as MP4: a folder read skips (and names) the MP4
    assert load_study(SAMPLES_DIR / "us_cardiac").warnings == ["skipped cine.mp4: not a DICOM file"]
