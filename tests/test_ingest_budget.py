"""Ingest's memory budget: a study is costed from its headers and refused over the budget before a pixel is
decoded, and a study inside it never costs more than the cost it was admitted at (decode is frame by frame into one
display array). Memory is measured with tracemalloc, which sees numpy's buffers."""

from __future__ import annotations

import time
import tracemalloc
import zipfile

import numpy as np
import pytest

from edgekit.errors import StudyTooLargeError
from edgekit.ingest import IngestLimits, load_study

from ingest_factory import deflated_zeros, make_dataset, ramp, rle_bomb, save, write_mp4

MiB = 2**20


def _peak(fn):
    """(result or exception, peak traced bytes, seconds) of fn()."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as err:  # noqa: BLE001 - the tests check which
        out = err
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, peak, seconds


def test_a_decompression_bomb_is_refused_from_its_headers(tmp_path):
    # 3 MB of RLE that decodes to 12 x 4096^2 pixels: 768 MiB of float32 display values, more with working space
    path = rle_bomb(tmp_path / "bomb.dcm", frames=12)
    assert path.stat().st_size < 4 * MiB
    err, peak, seconds = _peak(lambda: load_study(path, limits=IngestLimits(memory_bytes=512 * MiB)))
    assert isinstance(err, StudyTooLargeError), err
    assert err.code == "study_too_large" and err.http_status == 413
    assert "over the ingest memory budget of 512 MiB" in err.reason and "[limits] ingest_memory_bytes" in err.reason
    assert peak < 16 * MiB, f"refusing it cost {peak / MiB:.0f} MiB: it was decoded"
    assert seconds < 5


def test_a_study_inside_the_budget_costs_no_more_than_its_cost(tmp_path):
    # 8 frames of 512x512, 16-bit, no window: the series-wide min-max path, which used to copy the study twice
    pixels = np.stack([ramp(512, 512, offset=50 * k) for k in range(8)])
    path = save(make_dataset(pixels), tmp_path / "multi.dcm")
    display = 8 * 512 * 512 * 4
    study, peak, _ = _peak(lambda: load_study(path, limits=IngestLimits(memory_bytes=64 * MiB)))
    assert study.frames.shape == (8, 512, 512) and study.frames.dtype == np.float32
    assert 0.0 == study.frames.min() and study.frames.max() == 1.0
    # its cost: the display frames, one frame's working set and the encoded pixel data (4 MiB)
    cost = display + 2 * 512 * 512 * 2 + 512 * 512 * 4 * 3 + pixels.nbytes
    assert peak <= cost, f"decoding took {peak / MiB:.1f} MiB, the budget counted {cost / MiB:.1f} MiB"
    with pytest.raises(StudyTooLargeError):  # and that cost is what the budget is held to
        load_study(path, limits=IngestLimits(memory_bytes=display))


def test_frame_by_frame_decode_gives_the_same_display_values_as_the_whole_array(tmp_path):
    # the transform every reader shares, applied to the whole stack at once, is the reference
    from edgekit.ingest.pixels import to_display

    pixels = np.stack([ramp(64, 64, offset=300 * k) for k in range(5)]).astype(np.uint16)
    study = load_study(save(make_dataset(pixels, slope=2.0, intercept=-1024.0), tmp_path / "m.dcm"))
    np.testing.assert_allclose(study.frames, to_display(pixels, slope=2.0, intercept=-1024.0), atol=1e-6)
    windowed = load_study(save(make_dataset(pixels, window=(800, 1200)), tmp_path / "w.dcm"))
    np.testing.assert_allclose(windowed.frames, to_display(pixels, center=800, width=1200), atol=1e-6)


def test_a_deflate_bomb_is_refused_before_it_is_inflated(tmp_path):
    # ~0.3 MB on disk, 256 MiB inflated; the budget lets a Deflated object inflate to a quarter of itself
    path = deflated_zeros(tmp_path / "deflated.dcm", 1024, 1024, 128)
    assert path.stat().st_size < 2 * MiB
    err, peak, _ = _peak(lambda: load_study(path, limits=IngestLimits(memory_bytes=256 * MiB)))
    assert isinstance(err, StudyTooLargeError), err
    assert "Deflated dataset inflates past 64 MiB" in err.reason
    assert peak < 16 * MiB, f"refusing it cost {peak / MiB:.0f} MiB"
    small = deflated_zeros(tmp_path / "small.dcm", 64, 64, 2)  # a legitimate one still reads
    assert load_study(small).frames.shape == (2, 64, 64)


def test_a_zip_of_many_small_images_is_refused_as_soon_as_it_passes_the_budget(tmp_path):
    study_uid, series_uid = "1.2.3.4", "1.2.3.4.5"
    archive = tmp_path / "many.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for k in range(300):
            ds = make_dataset(ramp(128, 128), study_uid=study_uid, series_uid=series_uid, instance=k + 1)
            save(ds, tmp_path / "one.dcm")
            zf.write(tmp_path / "one.dcm", f"IM{k:04d}.dcm")
    # 300 x 64 KiB of display values = 18.75 MiB; the budget is 4 MiB: refused after about 64 files, not 300
    err, peak, _ = _peak(lambda: load_study(archive, limits=IngestLimits(memory_bytes=4 * MiB)))
    assert isinstance(err, StudyTooLargeError), err
    read = int(err.reason.split("decoding the ")[1].split(" images")[0])
    assert read <= 70, err.reason
    assert peak < 8 * MiB


def test_a_zip_member_larger_than_the_budget_is_refused_unread(tmp_path):
    archive = tmp_path / "big.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("IM0001.dcm", bytes(64 * MiB))  # 64 KB compressed
    err, peak, _ = _peak(lambda: load_study(archive, limits=IngestLimits(memory_bytes=16 * MiB)))
    assert isinstance(err, StudyTooLargeError) and "reading this file" in err.reason
    assert peak < 4 * MiB


def test_admit_hears_the_cost_before_decoding_and_can_refuse(tmp_path):
    path = rle_bomb(tmp_path / "ok.dcm", rows=256, cols=256, frames=4)
    heard = []

    class Busy(Exception):
        pass

    def admit(cost):
        heard.append(cost)
        raise Busy

    with pytest.raises(Busy):
        load_study(path, admit=admit)
    assert heard and heard[0] >= 4 * 256 * 256 * 4
    study = load_study(path, admit=heard.append)
    assert study.frames.shape == (4, 256, 256) and len(heard) == 2


def test_video_source_frames_and_decode_time_are_capped(tmp_path):
    path = write_mp4(tmp_path / "clip.mp4", frames=40)
    with pytest.raises(Exception) as info:
        load_study(path, limits=IngestLimits(video_max_source_frames=30))
    assert "more than 30 frames" in str(info.value)
    with pytest.raises(Exception) as info:
        load_study(path, limits=IngestLimits(video_decode_s=1e-9, video_max_frames=64))
    assert "took longer than" in str(info.value)
    assert load_study(path).frames.shape[0] == 40


def test_a_series_read_back_one_object_at_a_time_gives_the_same_frames(tmp_path, monkeypatch):
    # with a budget this small only the first objects are kept whole; the others keep their headers and are read
    # again to decode (four of six here: counted by watching the real drop_pixels, which still runs)
    import edgekit.ingest.load as load

    from ingest_factory import write_rle_series

    write_rle_series(tmp_path / "series", n=6)
    whole = load_study(tmp_path / "series")
    dropped = []
    real = load.drop_pixels
    monkeypatch.setattr(load, "drop_pixels", lambda img, reload: (dropped.append(img.ordinal), real(img, reload)))
    headers_only = load_study(tmp_path / "series", limits=IngestLimits(memory_bytes=512 * 1024))
    assert len(dropped) == 4
    np.testing.assert_array_equal(whole.frames, headers_only.frames)
    assert whole.meta == headers_only.meta and whole.warnings == headers_only.warnings


def test_what_headers_hold_is_costed_too(tmp_path):
    # 100 files with a 1 MiB private element each, a few KB zipped: their pixel data is tiny, their headers are not
    from pydicom.tag import Tag

    archive = tmp_path / "private.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for k in range(100):
            ds = make_dataset(ramp(8, 8), study_uid="1.2.3", series_uid="1.2.3.4", instance=k + 1)
            ds.add_new(Tag(0x0011, 0x0010), "LO", "VENDOR")
            ds.add_new(Tag(0x0011, 0x1001), "OB", bytes(MiB))
            save(ds, tmp_path / "one.dcm")
            zf.write(tmp_path / "one.dcm", f"IM{k:04d}.dcm")
    assert archive.stat().st_size < MiB
    err, peak, _ = _peak(lambda: load_study(archive, limits=IngestLimits(memory_bytes=32 * MiB)))
    # once 4 MiB are held, headers are kept without their private elements: the study fits, and costs what it said
    assert not isinstance(err, Exception), err
    assert peak < 32 * MiB, f"{peak / MiB:.0f} MiB"


def test_a_voi_lut_shorter_than_it_declares_is_ignored_as_before_not_a_crash(tmp_path):
    # 4096 entries declared, 10 present: a pre-check on a single value passed it; a real frame then failed
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    pixels = ramp(16, 16)
    ds = make_dataset(pixels)
    lut = Dataset()
    lut.LUTDescriptor = [4096, 0, 12]
    lut.add_new(0x00283006, "US", list(range(10)))
    ds.VOILUTSequence = Sequence([lut])
    study = load_study(save(ds, tmp_path / "short-lut.dcm"))
    assert any(w.startswith("ignored an unusable VOI LUT") for w in study.warnings), study.warnings
    from edgekit.ingest.pixels import to_display

    np.testing.assert_allclose(study.frames[0], to_display(pixels), atol=1e-6)


def test_a_skipped_slice_without_a_window_does_not_change_how_the_others_render(tmp_path):
    # three windowed slices and a fourth, unwindowed, whose pixel data is cut short: it is skipped, and the three
    # render with their own window, exactly as the series of three would
    from edgekit.ingest.pixels import to_display

    folder = tmp_path / "series"
    folder.mkdir()
    slices = [ramp(32, 32, offset=100 * k) for k in range(3)]
    for k, pixels in enumerate(slices):
        ds = make_dataset(pixels, study_uid="1.2.3", series_uid="1.2.3.4", instance=k + 1, window=(300, 500))
        save(ds, folder / f"IM{k:04d}.dcm")
    broken = make_dataset(ramp(32, 32), study_uid="1.2.3", series_uid="1.2.3.4", instance=4)
    broken.PixelData = broken.PixelData[:100]
    save(broken, folder / "IM0003.dcm")
    study = load_study(folder)
    assert study.num_frames == 3 and any("InstanceNumber 4" in w for w in study.warnings)
    expected = np.stack([to_display(p, center=300, width=500) for p in slices])
    np.testing.assert_allclose(study.frames, expected, atol=1e-6)
