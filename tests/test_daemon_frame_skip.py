"""edgekitd skips video frames while the served point says so: a profile with the same variant at full frames and
at `video_max_frames = 4`, a real MPEG-4 clip (PyAV) sent to /v1/reports and /v1/jobs, and the report JSON saying
how many of the clip's frames the model saw. `quality: "max"` and pinning the full-frame point give the clip its
frames back."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edgekit.bundle import load_bundle  # noqa: E402
from edgekit.daemon.client import study_files  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402
from edgekit.pareto import Point, Profile, write_profile  # noqa: E402

from ingest_factory import write_mp4  # noqa: E402

FRAMES = 8


def _point(name: str, bundle, energy_j: float, video_f1: float, **settings) -> Point:
    return Point(
        id=name, bundle=str(bundle), bundle_digest=load_bundle(bundle).digest, target="cpu", settings=settings,
        f1=0.98, f1_ci=(0.97, 0.99), hallucination_rate=0.0, latency_p50_ms=100, latency_p95_ms=120,
        energy_j=energy_j, energy_source="estimated:test-profile", peak_rss_mib=100.0, count=60,
        video_f1=video_f1, video_f1_ci=(video_f1 - 0.02, video_f1), video_count=15,
    )  # fmt: skip


def test_the_served_point_skips_video_frames_and_the_report_says_how_many(tmp_path):
    from edgekit.build import build

    bundle = tmp_path / "bundle"
    build("cpu", bundle, model_dir=write_tiny_model(tmp_path / "model", num_frames=FRAMES), parity=False)
    write_profile(
        Profile(
            [_point("full", bundle, 2.0, 1.0), _point("skip", bundle, 1.8, 0.97, video_max_frames=4)],
            split={"name": "test", "count": 60},
        ),
        tmp_path / "pareto.json",
    )
    (tmp_path / "sysfs").mkdir()  # no meters, battery or thermal zones: the mode alone decides
    config = tmp_path / "edgekitd.toml"
    config.write_text(
        f'[[variants]]\nname = "v"\nbundle = "{bundle}"\n'
        '[policy]\nprofile = "pareto.json"\nsignals_root = "sysfs"\ntick_s = 0.1\nmode = "saver"\n'
    )
    clip = write_mp4(tmp_path / "cine.mp4", frames=40)
    with DaemonProcess(tmp_path / "state", config=config).start() as d:
        state = d.client.get("/v1/policy").json()
        assert state["point"] == "skip"
        assert {p["id"]: p["video_f1"] for p in state["front"]} == {"full": 1.0, "skip": 0.97}

        r = d.client.report(clip)
        body = r.json()
        assert r.status == 200, body
        assert body["frames"] == {"used": 4, "of": 40, "model_frames": 4}
        assert any("frame skipping: the model saw 4 of the video's 40 frames" in w for w in body["warnings"])

        best = d.client.report(clip, quality="max").json()  # the best point: every frame the model takes
        assert best["frames"]["model_frames"] == FRAMES and best["variant"] == "v"

        job = d.client.post_study("/v1/jobs", study_files(clip))
        assert job.status == 202, job.json()
        done = d.client.wait_job(job.json()["id"])
        assert done["state"] == "succeeded" and done["report"]["frames"]["model_frames"] == 4

        r = d.client.put_json("/v1/policy", {"mode": "fixed", "fixed": "full"})
        assert r.status == 200 and r.json()["point"] == "full"
        body = d.client.report(clip).json()
        assert body["frames"] == {"used": FRAMES, "of": 40, "model_frames": FRAMES}
        assert not any("frame skipping" in w for w in body["warnings"])


def test_a_clip_the_precision_gate_reroutes_keeps_the_frames_and_the_cap_it_was_admitted_with(tmp_path):
    """The served point's knobs are read once, when the upload is admitted: a clip ingested with its frame skipping
    and then sent to the higher-precision variant by the gate is written under the same point's length cap too."""
    from edgekit.build import build

    bundles = {name: tmp_path / name for name in ("v", "hp")}
    for seed, (name, bundle) in enumerate(bundles.items()):
        model = write_tiny_model(tmp_path / f"model-{name}", seed=seed, num_frames=FRAMES)
        build("cpu", bundle, model_dir=model, parity=False)
    skip = _point("skip", bundles["v"], 1.0, 0.97, video_max_frames=4, max_new_tokens=3)
    write_profile(Profile([skip, _point("hp", bundles["hp"], 3.0, 1.0)], split={"name": "test", "count": 60}),
                  tmp_path / "pareto.json")  # fmt: skip
    (tmp_path / "sysfs").mkdir()
    config = tmp_path / "edgekitd.toml"
    config.write_text(
        "".join(f'[[variants]]\nname = "{n}"\nbundle = "{b}"\n' for n, b in bundles.items())
        + '[precision_gate]\nvariant = "hp"\nentropy_below = 4.2\n'
        + '[policy]\nprofile = "pareto.json"\nsignals_root = "sysfs"\ntick_s = 0.1\nmode = "saver"\n'
    )
    clip = write_mp4(tmp_path / "cine.mp4", frames=40)  # flat grey frames: low entropy, the gate reroutes
    with DaemonProcess(tmp_path / "state", config=config).start() as d:
        assert d.client.get("/v1/policy").json()["point"] == "skip"
        uncapped = d.client.report(clip, max_new_tokens="20", quality="max").json()  # hp, as asked: no knobs
        assert uncapped["variant"] == "hp" and uncapped["timings"]["new_tokens"] > 3, uncapped  # the cap can bite
        for body in (
            d.client.report(clip, max_new_tokens="20").json(),
            d.client.wait_job(
                d.client.post_study("/v1/jobs", study_files(clip), {"max_new_tokens": "20"}).json()["id"]
            )["report"],
        ):
            assert body["variant"] == "hp" and body["routing"]["precision_gate"]["routed"], body
            assert body["frames"] == {"used": 4, "of": 40, "model_frames": 4}
            assert body["timings"]["new_tokens"] <= 3  # the cap of the point that admitted it, not the client's 20
