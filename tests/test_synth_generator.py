"""Synthetic studies: deterministic, independent splits, and findings a 64x64 model can actually see."""

import hashlib
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from edgekit.errors import ConfigError
from edgekit.findings import KIND_BY_NAME, parse_report
from edgekit.ingest.pixels import to_display
from edgekit.models.synth import generate_study
from edgekit.models.synth.generator import generate_study_with

MODEL_SIZE, MODEL_FRAMES = 64, 8


def _display(s):
    return to_display(
        s.stored, slope=s.slope, intercept=s.intercept, center=s.center, width=s.width, photometric=s.photometric
    )


def _model_view(frames):
    """The frames the model samples, each area-downsampled to 64x64 (the contract's preprocessing)."""
    n = frames.shape[0]
    idx = [int((i + 0.5) * n / MODEL_FRAMES) for i in range(MODEL_FRAMES)]
    return np.stack(
        [
            np.asarray(
                Image.fromarray(np.ascontiguousarray(frames[i], np.float32), "F").resize(
                    (MODEL_SIZE, MODEL_SIZE), Image.BOX
                )
            )
            for i in idx
        ]
    )


def _digest(s) -> str:
    h = hashlib.sha256(s.stored.tobytes())
    h.update(repr((s.findings, s.negatives, s.indication, s.references, s.study_uid)).encode())
    return h.hexdigest()


def test_same_study_twice_is_identical():
    for i in range(4):
        a, b = generate_study(i, "train"), generate_study(i, "train")
        assert a.stored.dtype == b.stored.dtype and np.array_equal(a.stored, b.stored)
        assert (a.findings, a.negatives, a.references, a.study_uid) == (
            b.findings,
            b.negatives,
            b.references,
            b.study_uid,
        )


def test_order_of_generation_does_not_matter():
    forward = [_digest(generate_study(i, "val")) for i in range(4)]
    backward = [_digest(generate_study(i, "val")) for i in reversed(range(4))][::-1]
    assert forward == backward


def test_splits_do_not_overlap():
    train = {_digest(generate_study(i, "train")) for i in range(16)}
    test = {_digest(generate_study(i, "test")) for i in range(16)}
    sample = {_digest(generate_study(i, "sample")) for i in range(16)}
    assert len(train) == len(test) == len(sample) == 16
    assert not train & test and not train & sample and not test & sample


def test_kinds_balanced_and_about_a_quarter_normal():
    studies = [generate_study(i, "test") for i in range(80)]
    assert Counter(s.kind for s in studies) == {"ct_chest": 20, "mr_brain": 20, "cr_chest": 20, "us_cardiac": 20}
    normal = sum(not s.findings for s in studies) / len(studies)
    assert 0.12 <= normal <= 0.4
    assert max(len(s.findings) for s in studies) == 3


def test_contract_fields_and_ranges():
    for i in range(8):
        s = generate_study(i, "test")
        kind = KIND_BY_NAME[s.kind]
        n = s.stored.shape[0]
        assert s.stored.ndim == 3
        if s.modality == "CT":
            assert 10 <= n <= 16 and s.stored.dtype == np.int16 and s.intercept == -1024
        elif s.modality == "MR":
            assert 10 <= n <= 16 and s.stored.dtype == np.uint16
        elif s.modality in ("CR", "DX"):
            assert n == 1 and s.photometric in ("MONOCHROME1", "MONOCHROME2")
        else:
            assert 16 <= n <= 32 and s.stored.dtype == np.uint8 and s.fps
        assert s.pixel_spacing == (kind.pixel_spacing_mm, kind.pixel_spacing_mm)
        assert set(s.negatives) | {f.type for f in s.findings} == set(kind.types)
        assert s.indication in kind.indications
        for ref in s.references:
            parsed = parse_report(ref)
            assert (parsed.findings, parsed.negatives) == (s.findings, s.negatives)


@pytest.mark.parametrize("bad", [("test", -1), ("test", 1.5), ("holdout", 0), ("test", True)])
def test_bad_arguments_raise_config_error(bad):
    split, index = bad
    with pytest.raises(ConfigError):
        generate_study(index, split)


def test_every_finding_is_visible_at_model_resolution():
    """Remove one finding (anatomy and noise unchanged): at 64x64 about a 4-px disc worth of pixels must change by
    >= 0.2 of the display range in at least half of the 8 sampled frames."""
    seen = set()
    for i in range(48):
        s = generate_study(i, "test")
        view = _model_view(_display(s))
        for f in s.findings:
            other = generate_study_with(i, "test", [g for g in s.findings if g != f])
            changed = (np.abs(view - _model_view(_display(other))) >= 0.2).sum(axis=(1, 2))
            assert (changed >= 8).sum() >= 4 and changed.max() >= 10, (s.id, f, changed)
            seen.add(f.type)
    assert len(seen) == 10  # every finding type of every kind was checked


def test_size_in_pixels_maps_to_mm():
    checked = 0
    for i in range(60):
        s = generate_study(i, "test")
        for f in s.findings:
            if f.size_mm is None or f.count != 1:
                continue
            m = s.masks[f.type]
            widest = max(int(np.ptp(np.nonzero(m[k])[1])) + 1 for k in range(m.shape[0]) if m[k].any())
            expected = f.size_mm / s.pixel_spacing[1]
            assert abs(widest - expected) <= 0.15 * expected + 1, (s.id, f, widest, expected)
            assert expected * MODEL_SIZE / s.stored.shape[-1] >= 4  # >= 4 px across at 64x64
            checked += 1
    assert checked >= 10


def _components(mask: np.ndarray) -> int:
    seen = np.zeros_like(mask, bool)
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def test_nodule_count_matches_separate_blobs_on_the_correct_side():
    checked = 0
    for i in range(0, 120, 4):  # CT studies
        s = generate_study(i, "test")
        f = next((g for g in s.findings if g.type == "nodule"), None)
        if f is None:
            continue
        projection = s.masks["nodule"].any(axis=0)
        assert _components(projection) == f.count
        assert len(s.centres["nodule"]) == f.count  # where each one is drawn, inside its pixels
        assert all(projection[int(y), int(x)] for y, x in s.centres["nodule"])
        cols = np.nonzero(projection)[1]
        # patient's right is image left
        assert (cols < 64).all() if f.location == "right" else (cols >= 64).all()
        checked += 1
    assert checked >= 5
