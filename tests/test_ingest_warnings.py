"""Ingest warnings that travel with the study: a skipped slice named by InstanceNumber (or place) with the real
reason, decoder fallbacks and changed values stated, and never a path, a file name of a slice or a patient value.
Also the objects real exports hold that ingest used to refuse (pydicom's shipped files, item 10 of the issue)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.errors import StudyError
from edgekit.ingest import load_study
from edgekit.ingest.phi import scrub

from ingest_factory import PHI_ID, PHI_NAME, cut, make_dataset, ramp, save, save_pillow_compressed, write_rle_series

SECRETS = ("Secretname", "Johnathan", PHI_ID)


def _clean(warnings: list[str], *also: str) -> None:
    for w in warnings:
        for secret in (*SECRETS, *also):
            assert secret not in w, f"{secret!r} leaked into warning {w!r}"
        assert "/" not in w and "\\" not in w, f"a path in warning {w!r}"


def _phi_series(tmp_path, n=6):
    """A series as real exports name it: the folder and every file carry the patient's name."""
    folder = tmp_path / f"{PHI_NAME.replace('^', '_')}_{PHI_ID}"
    paths = write_rle_series(folder, n, name=lambda k: f"{PHI_NAME.replace('^', '_')}_{k + 1:03d}.dcm")
    return folder, paths


def test_a_truncated_slice_is_skipped_named_by_instance_number(tmp_path):
    folder, paths = _phi_series(tmp_path)
    cut(paths[3])  # InstanceNumber 4, cut inside its encapsulated pixel data
    study = load_study(folder)
    assert study.num_frames == 5  # still reported on
    about = [w for w in study.warnings if "InstanceNumber 4" in w]
    assert len(about) == 1, study.warnings  # one message, not three
    assert "truncated inside its pixel data" in about[0] and "of at least" in about[0]
    assert "without pixel data" not in " ".join(study.warnings)
    assert len(study.warnings) == 1, study.warnings  # no raw pydicom message beside it
    _clean(study.warnings, str(tmp_path))


def test_a_slice_with_an_unreadable_header_is_named_by_its_place(tmp_path):
    folder, paths = _phi_series(tmp_path)
    paths[2].write_bytes(paths[2].read_bytes()[:200])  # cut inside the header: no InstanceNumber to read
    study = load_study(folder)
    assert study.num_frames == 5
    assert len(study.warnings) == 1 and study.warnings[0].startswith("skipped file 3 of 6: "), study.warnings
    _clean(study.warnings, str(tmp_path))


def test_the_same_from_a_zip(tmp_path):
    import zipfile

    folder, paths = _phi_series(tmp_path)
    cut(paths[0])
    archive = tmp_path / "study.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for p in paths:
            zf.write(p, f"{folder.name}/{p.name}")
    study = load_study(archive)
    assert study.num_frames == 5
    assert len(study.warnings) == 1 and "InstanceNumber 1" in study.warnings[0]
    _clean(study.warnings, str(tmp_path))


def test_a_series_with_every_slice_broken_fails_with_the_first_reason(tmp_path):
    folder, paths = _phi_series(tmp_path, n=2)
    for p in paths:
        cut(p)
    with pytest.raises(StudyError, match="truncated inside its pixel data"):
        load_study(folder)


def test_pydicom_messages_lose_their_paths():
    out = scrub("End of file reached before delimiter (FFFE,E0DD) found in file /exports/Doe_John/IM0007.dcm")
    assert "Doe_John" not in out and "IM0007" not in out and "(FFFE,E0DD)" in out
    assert "Doe" not in scrub(r"bad element in C:\exports\Doe\IM1.dcm")
    assert (
        scrub("a/b ratio and YBR_FULL_422 1.2.840.10008.1.2.4.51")
        == "a/b ratio and YBR_FULL_422 1.2.840.10008.1.2.4.51"
    )


def test_changed_values_are_stated_and_name_the_slice(tmp_path):
    # Float pixel data with NaN: to_display would have mapped them to 0 without a word.
    pixels = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    pixels[2, 3] = np.nan
    pixels[5, 5] = np.inf
    ds = make_dataset(ramp(8, 8), instance=9)
    del ds.PixelData
    ds.BitsAllocated = 32
    ds.FloatPixelData = pixels.tobytes()
    for tag in ("BitsStored", "HighBit", "PixelRepresentation"):
        delattr(ds, tag)
    study = load_study(save(ds, tmp_path / f"{PHI_NAME}.dcm"))
    assert any("replaced 2 non-finite" in w for w in study.warnings), study.warnings
    assert np.isfinite(study.frames).all()
    _clean(study.warnings)


def test_notes_of_a_series_name_slices_not_files(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    from pydicom.uid import generate_uid

    study_uid, series = generate_uid(), generate_uid()
    for k in range(3):
        ds = make_dataset(ramp(), study_uid=study_uid, series_uid=series, instance=k + 1, window=(100, 0.5))
        save(ds, folder / f"{PHI_NAME}_{k}.dcm")
    study = load_study(folder)
    assert study.warnings == ["ignored a window width below 1 (InstanceNumber 1, InstanceNumber 2, InstanceNumber 3)"]


# --- item 8: truncated inside the pixel data is said so, with the byte counts


def test_single_file_truncated_inside_encapsulated_pixel_data(tmp_path):
    (path,) = write_rle_series(tmp_path / "one", 1)
    cut(path, 0.7)
    with pytest.raises(StudyError) as info:
        load_study(path)
    reason = info.value.reason
    assert "no pixel data" not in reason and "not an image" not in reason
    assert "truncated inside its pixel data" in reason and "bytes of encapsulated pixel data present" in reason


def test_single_file_truncated_inside_native_pixel_data(tmp_path):
    path = save(make_dataset(ramp(64, 64)), tmp_path / "a.dcm")
    cut(path, 0.6)
    with pytest.raises(StudyError) as info:
        load_study(path)
    assert "truncated inside its pixel data" in info.value.reason
    assert f"of {64 * 64 * 2} bytes" in info.value.reason


# --- item 10: objects real exports hold


def _ybr_full_422(rows=4, cols=6):
    """Native YBR_FULL_422: per pair of pixels Y1 Y2 Cb Cr, i.e. two bytes per pixel, not three."""
    y = (np.arange(rows * cols, dtype=np.int64).reshape(rows, cols) * 9 + 20).astype(np.uint8)
    packed = np.empty((rows, cols // 2, 4), dtype=np.uint8)
    packed[..., 0], packed[..., 1] = y[:, 0::2], y[:, 1::2]
    packed[..., 2] = packed[..., 3] = 128  # no chroma: grey
    ds = make_dataset(np.zeros((rows, cols, 3), dtype=np.uint8), photometric="RGB")
    ds.PhotometricInterpretation = "YBR_FULL_422"
    ds.PixelData = packed.tobytes()
    return ds, y


def test_uncompressed_ybr_full_422_is_read(tmp_path):
    ds, y = _ybr_full_422()
    study = load_study(save(ds, tmp_path / "ybr.dcm"))
    expected = (y - y.min()) / (y.max() - y.min())
    np.testing.assert_allclose(study.frames[0], expected, atol=0.02)


def test_a_corrupt_jpeg2000_size_is_named_as_such(tmp_path):
    pixels = ramp(dtype=np.uint16, scale=13)
    path = save_pillow_compressed(make_dataset(pixels), pixels, tmp_path / "j2k.dcm", "j2k")
    data = bytearray(path.read_bytes())
    siz = data.find(b"\xff\x4f\xff\x51")
    data[siz + 8 : siz + 12] = b"\xfe\xff\xdd\xe0"  # Xsiz: what pydicom's embedded-delimiter sample carries
    path.write_bytes(bytes(data))
    with pytest.raises(StudyError) as info:
        load_study(path)
    assert "corrupt JPEG 2000 codestream" in info.value.reason and "16x16" in info.value.reason


def test_a_malformed_number_of_frames_is_refused_as_such(tmp_path):
    ds = make_dataset(ramp())
    ds.NumberOfFrames = 11
    path = save(ds, tmp_path / "bad.dcm")
    element = b"\x28\x00\x08\x00IS\x02\x0011"  # (0028,0008) IS, 2 bytes: pydicom's badVR.dcm holds "1A"
    path.write_bytes(path.read_bytes().replace(element, element[:-1] + b"A"))
    with pytest.raises(StudyError) as info:
        load_study(path)
    assert "NumberOfFrames is not an integer" in info.value.reason


@pytest.mark.parametrize("name", ["JPGExtended.dcm", "JPEG-lossy.dcm"])
def test_12_bit_jpeg_extended_is_decoded_with_gdcm(name):
    import gdcm  # noqa: F401 - a core dependency: a missing one fails here, not skips
    from pydicom.data import get_testdata_file

    path = get_testdata_file(name, download=False)  # shipped inside pydicom's wheel
    if path is None:
        pytest.skip(f"{name} not installed")
    study = load_study(path)
    assert study.frames.shape == (1, 1024, 256)
    assert any("decoded by GDCM" in w for w in study.warnings)
    from edgekit.ingest.decode import decode_image
    from edgekit.ingest.dicom import inspect_image, read_dataset
    from edgekit.ingest.study import IngestLimits

    img = inspect_image(read_dataset(Path(path), name), name, IngestLimits())
    stored = np.stack(list(decode_image(img, img.ds).frames))  # frame by frame, as the assembler reads them
    assert stored[0, 420, 140] == 244 and stored[0, 230, 120] == 95 and stored.max() == 264
