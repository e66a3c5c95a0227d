"""What the reporter checks before it spends time: the prompt against the model's context, and what it tells the
user about the study (ingest warnings) and about options it had to change."""

from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest

from edgekit.build import build
from edgekit.reporter import PromptTooLongError, Reporter

SAMPLES = Path(str(files("edgekit.models") / "samples"))


@pytest.fixture(scope="module")
def reporter(tmp_path_factory):
    bundle = build("cpu", tmp_path_factory.mktemp("rl") / "cpu", parity=False).bundle
    return Reporter.from_bundle(bundle, threads=1)


def test_a_prompt_that_leaves_no_room_is_refused_before_any_work(reporter):
    assert reporter.context.positions == 256 and reporter.context.image_tokens == 16
    with pytest.raises(PromptTooLongError, match=r"context of 256 positions .* at most 239 prompt tokens") as err:
        reporter.report(SAMPLES / "cr_chest", "cough " * 1000)
    assert err.value.code == "prompt_too_long" and err.value.http_status == 422


def test_max_new_tokens_is_lowered_to_what_fits_and_the_report_says_so(reporter):
    prompt = "cough " * 60
    n_prompt = reporter.prompt_ids("CR", prompt).shape[1]
    room = 256 - 16 - n_prompt
    opts = reporter.default_options
    opts.max_new_tokens = 200
    report = reporter.report(SAMPLES / "cr_chest", prompt, opts)
    assert opts.max_new_tokens == 200  # the caller's options are left as they were
    assert report.timings["new_tokens"] <= room
    assert any(f"max_new_tokens lowered from 200 to {room}" in w for w in report.warnings)


def test_ingest_time_is_measured_when_the_study_was_loaded_beforehand(reporter, tmp_path):
    from edgekit.ingest import load_study

    study = load_study(SAMPLES / "ct_chest")
    assert study.ingest_ms > 1.0  # fourteen slices read and decoded
    assert reporter.report(study, "Cough.").timings["ingest_ms"] == study.ingest_ms


def test_ingest_warnings_travel_with_the_report(reporter, tmp_path):
    series = tmp_path / "ct"
    shutil.copytree(SAMPLES / "ct_chest", series)
    (series / "notes.txt").write_text("not an image")
    report = reporter.report(series, "Cough.")
    assert any("notes.txt" in w for w in report.warnings)


def test_eval_refuses_a_limit_below_one_instead_of_slicing_from_the_end(reporter, tmp_path):
    from edgekit.errors import ConfigError
    from edgekit.eval.runner import evaluate

    for bad in (-1, 0):
        with pytest.raises(ConfigError, match="limit must be >= 1"):
            evaluate(reporter, tmp_path, limit=bad)


class _CountingTokenizer:
    """The reporter's own tokenizer, counting its encodes (what fitting a prompt costs)."""

    def __init__(self, inner):
        self.inner, self.encodes = inner, 0

    def encode(self, *args, **kwargs):
        self.encodes += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_prompt_fitted_once_is_not_tokenised_again_and_keeps_its_warnings(reporter, monkeypatch):
    """The daemon fits a request's prompt when it admits it; the report reuses that, for the same modality and
    text, and fits again for any other."""
    from edgekit.ingest import load_study

    study = load_study(SAMPLES / "cr_chest")
    counting = _CountingTokenizer(reporter.tokenizer)
    monkeypatch.setattr(reporter, "tokenizer", counting)
    opts = reporter.default_options
    opts.max_new_tokens = 250  # more than the context leaves: the fit lowers it and says so
    fitted = reporter.fit_prompt(study.modality, "cough", opts)
    assert counting.encodes == 1 and any("max_new_tokens lowered" in w for w in fitted.warnings)
    once = reporter.report(study, "cough", fitted=fitted)
    assert counting.encodes == 1  # the report did not tokenise the prompt again
    again = reporter.report(study, "cough", opts)
    assert counting.encodes == 2 and once.text == again.text and once.warnings == again.warnings
    other = reporter.fit_prompt("MR", "cough", opts)
    reporter.report(study, "cough", fitted=other)  # another modality's fit is not this study's: fitted anew
    assert counting.encodes == 4


def test_a_one_frame_study_is_encoded_once_with_the_features_of_its_repeats(reporter):
    """The encoder pools frames by mean and deviation, so a radiograph repeated to the model's frames pools as
    itself: it is encoded once, an eighth of the encoder's work, with the same features."""
    from edgekit.ingest import load_study
    from edgekit.preprocess import preprocess_frames

    cr, ct = load_study(SAMPLES / "cr_chest"), load_study(SAMPLES / "ct_chest")
    once = reporter.pixel_values(cr)
    repeated = preprocess_frames(cr.frames, reporter.image_config)[None]
    assert once.shape[1] == 1 and repeated.shape[1] == reporter.image_config.num_frames == 8
    assert reporter.pixel_values(ct).shape[1] == 8  # fourteen slices: sampled to the model's eight, as before
    np.testing.assert_allclose(
        reporter.backend.encode_images(once), reporter.backend.encode_images(repeated), rtol=0, atol=1e-5
    )
    assert reporter.frames_used(cr, warnings := []) == {"used": 1, "of": 1, "model_frames": 1} and not warnings
