"""Pixels -> display values -> model input: the contract in docs/interfaces.md ("Pixels")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgekit.errors import ConfigError
from edgekit.ingest.pixels import to_display
from edgekit.preprocess import PreprocessConfig, preprocess_frames, sample_indices

# --- to_display ---------------------------------------------------------------------------------------------


def test_linear_voi_matches_the_standard_formula():
    stored = np.array([[0, 1000, 1040, 1080, 2000]], dtype=np.uint16)
    # slope 1, intercept -1024 => values -1024, -24, 16, 56, 976; window c=40 w=80
    out = to_display(stored, slope=1.0, intercept=-1024.0, center=40, width=80)
    x = stored.astype(np.float64) - 1024
    expected = np.clip((x - 39.5) / 79 + 0.5, 0, 1)
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert out.dtype == np.float32 and out.shape == stored.shape


def test_window_width_one_is_a_threshold():
    out = to_display(np.array([9, 10, 11]), center=10.5, width=1)
    np.testing.assert_array_equal(out, [0, 0, 1])


def test_no_window_is_min_max_over_whole_array():
    stored = np.stack([np.full((2, 2), 10), np.full((2, 2), 30)]).astype(np.int16)
    out = to_display(stored, slope=2.0)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[1], 1.0)
    assert out.shape == (2, 2, 2)


def test_constant_image_does_not_divide_by_zero():
    out = to_display(np.full((3, 3), 7, dtype=np.uint8))
    assert np.all(out == 0.0)


def test_monochrome1_is_inverted_after_windowing():
    stored = np.array([[0, 50, 100]], dtype=np.uint8)
    m2 = to_display(stored, center=50, width=100)
    m1 = to_display(stored, center=50, width=100, photometric="MONOCHROME1")
    np.testing.assert_allclose(m1, 1.0 - m2, atol=1e-7)
    assert m1[0, 0] == pytest.approx(1.0) and m1[0, 2] == pytest.approx(0.0)


def test_rgb_becomes_bt601_luminance():
    rgb = np.zeros((1, 2, 2, 3), dtype=np.uint8)
    rgb[0, 0, 0] = [255, 0, 0]
    rgb[0, 0, 1] = [0, 255, 0]
    rgb[0, 1, 0] = [0, 0, 255]
    out = to_display(rgb, center=127.5, width=256, photometric="RGB")
    assert out.shape == (1, 2, 2)
    expected_luma = np.array([[0.299, 0.587], [0.114, 0.0]]) * 255
    expected = np.clip((expected_luma - 127.0) / 255 + 0.5, 0, 1)
    np.testing.assert_allclose(out[0], expected, atol=1e-5)


def test_greyscale_three_wide_frames_are_not_taken_for_rgb():
    stored = np.arange(18, dtype=np.uint8).reshape(2, 3, 3)
    assert to_display(stored).shape == (2, 3, 3)


def test_nan_in_float_pixels_does_not_poison_the_result():
    out = to_display(np.array([[np.nan, 0.0, 1.0]], dtype=np.float32))
    assert np.all(np.isfinite(out)) and out.max() == 1.0


# --- frame sampling and preprocess_frames ------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 8), (5, 8), (8, 8), (13, 8), (100, 8), (7, 3)])
def test_sample_indices_follow_the_contract(n, k):
    got = sample_indices(n, k)
    expected = [int(np.floor((i + 0.5) * n / k)) for i in range(k)]
    assert got.tolist() == expected
    assert got.min() >= 0 and got.max() < n


def test_preprocess_picks_frames_resizes_with_box_and_normalises():
    n, h, w = 13, 32, 48
    frames = np.stack([np.full((h, w), i / 20, dtype=np.float32) for i in range(n)])
    cfg = PreprocessConfig(image_size=16, num_frames=8, mean=0.25, std=0.5)
    out = preprocess_frames(frames, cfg)
    assert out.shape == (8, 1, 16, 16) and out.dtype == np.float32
    for i in range(8):
        j = int(np.floor((i + 0.5) * n / 8))
        np.testing.assert_allclose(out[i, 0], (j / 20 - 0.25) / 0.5, atol=1e-6)


def test_box_resize_is_an_area_average():
    rng = np.random.default_rng(0)
    frame = rng.random((64, 64), dtype=np.float32)
    out = preprocess_frames(frame, PreprocessConfig(image_size=32, num_frames=1, mean=0.0, std=1.0))
    expected = frame.reshape(32, 2, 32, 2).mean(axis=(1, 3))
    np.testing.assert_allclose(out[0, 0], expected, atol=1e-5)


def test_preprocess_is_deterministic():
    rng = np.random.default_rng(1)
    frames = rng.random((20, 70, 90), dtype=np.float32)
    a = preprocess_frames(frames)
    b = preprocess_frames(frames.copy())
    assert a.tobytes() == b.tobytes()


def test_preprocess_rejects_empty_input():
    with pytest.raises(ValueError):
        preprocess_frames(np.zeros((0, 4, 4), dtype=np.float32))


# --- PreprocessConfig ----------------------------------------------------------------------------------------


def test_config_round_trips_through_a_file(tmp_path):
    cfg = PreprocessConfig(image_size=96, num_frames=4, mean=0.4, std=0.2)
    path = cfg.save(tmp_path)
    assert path.name == "preprocessor_config.json"
    assert PreprocessConfig.load(path) == cfg
    assert PreprocessConfig.load(tmp_path) == cfg
    assert PreprocessConfig.from_dict(cfg.to_dict()) == cfg
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_config_ignores_unknown_keys(tmp_path):
    data = {"image_size": 32, "num_frames": 2, "mean": 0.5, "std": 0.5, "processor_class": "X"}
    assert PreprocessConfig.from_dict(data) == PreprocessConfig(image_size=32, num_frames=2)


def test_config_bad_json_names_the_file(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError) as info:
        PreprocessConfig.load(path)
    assert str(path) in str(info.value) and "JSON" in str(info.value)


@pytest.mark.parametrize(
    "bad", [{"image_size": 0}, {"num_frames": -1}, {"std": 0.0}, {"image_size": "64"}, {"mean": float("nan")}]
)
def test_config_rejects_bad_values(tmp_path, bad):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError) as info:
        PreprocessConfig.load(path)
    assert str(path) in str(info.value)
    assert next(iter(bad)) in info.value.reason


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        PreprocessConfig.load(tmp_path / "nope.json")
