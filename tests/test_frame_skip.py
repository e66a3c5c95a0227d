"""Frame skipping for video: a lower `video_max_frames` feeds the vision encoder fewer frames (the encoder pools
across frames, so it takes any count), the report says how many frames it used of how many, the X1 bills less
for the encoder, and DICOM studies are left as they were. Clips are real MPEG-4 files written with PyAV."""

from __future__ import annotations

import numpy as np
import pytest

from edgekit.ingest import IngestLimits, load_study
from edgekit.pareto import Point, non_dominated

from ingest_factory import write_mp4

FRAMES = 8  # the model's own frames per study in these tests (the embedded model's count)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    from edgekit.build import build
    from edgekit.daemon.testing import write_tiny_model

    root = tmp_path_factory.mktemp("frame-skip")
    model = write_tiny_model(root / "model", num_frames=FRAMES)
    out = {}
    for target in ("cpu", "x1"):
        out[target] = root / f"bundle-{target}"
        build(target, out[target], model_dir=model, parity=False)
    return out


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_mp4(tmp_path_factory.mktemp("clip") / "cine.mp4", frames=40)


def _reporter(bundle, video_max_frames=None):
    from edgekit.reporter import Reporter

    limits = IngestLimits(video_max_frames=video_max_frames) if video_max_frames else None
    return Reporter.from_bundle(bundle, limits=limits)


def test_a_lower_frame_cap_feeds_the_encoder_fewer_frames_and_says_so(bundles, clip):
    full = _reporter(bundles["cpu"]).report(clip, options=None)
    assert full.frames == {"used": FRAMES, "of": 40, "model_frames": FRAMES}
    assert not any("frame skipping" in w for w in full.warnings)

    skip = _reporter(bundles["cpu"], video_max_frames=4)
    study = load_study(clip, limits=skip.limits)
    assert study.meta["video_max_frames"] == 4 and study.num_frames == 4
    assert skip.pixel_values(study).shape[1] == 4  # not 4 frames repeated to 8
    report = skip.report(clip)
    assert report.frames == {"used": 4, "of": 40, "model_frames": 4}
    assert any("frame skipping: the model saw 4 of the video's 40 frames" in w for w in report.warnings)
    assert report.to_dict()["frames"]["used"] == 4  # in the JSON the CLI and the daemon write


def test_a_short_clip_is_repeated_as_in_training_and_a_cap_above_the_model_count_changes_nothing(bundles, tmp_path):
    short = write_mp4(tmp_path / "short.mp4", frames=5)
    r = _reporter(bundles["cpu"]).report(short)
    assert r.frames == {"used": 5, "of": 5, "model_frames": FRAMES} and not r.warnings
    wide = _reporter(bundles["cpu"], video_max_frames=FRAMES)
    clip = write_mp4(tmp_path / "long.mp4", frames=40)
    a = wide.pixel_values(load_study(clip, limits=wide.limits))
    b = _reporter(bundles["cpu"]).pixel_values(load_study(clip))
    assert a.shape == b.shape == (1, FRAMES, 1, 32, 32)  # the cap only bites below the model's count
    # the same source frames either way (display values are min-max over the frames kept, so compare ranks)
    assert np.argsort(a.mean(axis=(0, 2, 3, 4))).tolist() == np.argsort(b.mean(axis=(0, 2, 3, 4))).tolist()


def test_dicom_studies_ignore_the_video_frame_cap(bundles, tmp_path):
    from ingest_factory import write_series

    folder = tmp_path / "series"
    write_series(folder, n=12)
    capped = _reporter(bundles["cpu"], video_max_frames=2)
    study = load_study(folder, limits=capped.limits)
    assert capped.model_frames(study) == FRAMES
    assert capped.report(folder).frames == {"used": FRAMES, "of": 12, "model_frames": FRAMES}


def test_the_x1_bills_less_for_the_encoder_with_half_the_frames(bundles, clip):
    costs = {}
    for frames in (FRAMES, FRAMES // 2):
        report = _reporter(bundles["x1"], video_max_frames=frames).report(clip)
        assert report.energy_source == "emulated:x1" and report.frames["model_frames"] == frames
        costs[frames] = report.cost["phases"]["encode"]
    half, full = costs[FRAMES // 2]["mj"], costs[FRAMES]["mj"]
    assert half < full, costs  # per-frame work halves; in this tiny encoder fixed costs dominate (radreport-tiny:
    # 0.25 -> 0.16 mJ, bench/frame_skip.py)
    assert costs[FRAMES // 2]["ms"] < costs[FRAMES]["ms"]


def _point(name, energy, f1, video_f1=None, **settings):
    return Point(
        id=name, bundle="b", bundle_digest="d", target="x1", settings=settings, f1=f1, f1_ci=(f1, f1),
        hallucination_rate=0.0, latency_p50_ms=1.0, latency_p95_ms=1.0, energy_j=energy, energy_source="emulated:x1",
        peak_rss_mib=1.0, count=60, video_f1=video_f1, video_f1_ci=None if video_f1 is None else (video_f1, video_f1),
    )  # fmt: skip


def test_a_point_that_skips_frames_pays_in_video_f1_on_the_front_and_the_policy():
    from edgekit.daemon.policy import Constraints, PolicySettings, Signals, choose

    full = _point("full", 2.0, 0.98, 1.0)
    skip = _point("skip", 1.9, 0.98, 0.97, video_max_frames=4)
    assert {p.id for p in non_dominated([full, skip])} == {"full", "skip"}  # a trade-off, not a free lunch
    no_video = [_point("a", 2.0, 0.98), _point("b", 1.9, 0.98)]
    assert [p.id for p in non_dominated(no_video)] == ["b"]  # without video F1 the old rule stands
    signals = Signals()
    assert choose([full, skip], PolicySettings(mode="performance"), signals, None).point.id == "full"
    assert choose([full, skip], PolicySettings(mode="saver"), signals, None).point.id == "skip"
    floor = PolicySettings(mode="saver", constraints=Constraints(quality_floor_f1=0.975))
    assert Constraints(quality_floor_f1=0.975).broken_by(skip) == ["quality_floor_f1"]
    assert choose([full, skip], floor, signals, None).point.id == "full"
    back = Point.from_dict(skip.to_dict(), "test")
    assert back == skip and back.video_f1_ci == (0.97, 0.97)


def test_a_pareto_point_scores_the_split_s_video_clips_apart(bundles, tmp_path):
    from edgekit.bundle import load_bundle
    from edgekit.models.synth import write_split
    from edgekit.pareto.configs import expand
    from edgekit.pareto.measure import measure

    split = write_split(tmp_path / "test", "test", 4).parent
    clips = sum(1 for line in (split / "studies.jsonl").read_text().splitlines() if '"video_path"' in line)
    assert clips >= 1  # the synthetic split's cardiac cine loops carry an MP4 copy
    (config,) = expand([load_bundle(bundles["x1"])], {"video_max_frames": [4]})
    point = Point.from_dict(measure(config, split, limit=4), "test")
    assert point.settings["video_max_frames"] == 4 and point.video_count == clips and point.count == 4
    assert point.video_f1 is not None and point.video_f1_ci is not None and point.energy_source == "emulated:x1"


def test_a_point_without_energy_never_beats_one_with_it_and_unmetered_points_still_have_a_front():
    metered = _point("metered", 2.0, 0.98)
    unmetered = _point("unmetered", float("nan"), 0.98)
    assert [p.id for p in non_dominated([metered, unmetered])] == ["metered"]
    better = _point("better", float("nan"), 0.99)
    assert [p.id for p in non_dominated([unmetered, better])] == ["better"]  # F1 and latency still decide
