"""Every kind of bad input is a StudyError that names the file and the reason (never a stray exception)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
from pydicom.uid import JPEG2000Lossless, generate_uid

from edgekit.errors import EdgekitError, StudyError, UnsupportedTransferSyntaxError
from edgekit.ingest import IngestLimits, load_study

from ingest_factory import make_dataset, ramp, save, write_series


def _fails(path, exc=StudyError, **kw):
    with pytest.raises(exc) as info:
        load_study(path, **kw)
    err = info.value
    assert isinstance(err, EdgekitError)
    return err, str(err)


def test_missing_path(tmp_path):
    err, msg = _fails(tmp_path / "nope.dcm")
    assert "no such file" in msg and "nope.dcm" in msg


def test_not_a_dicom_file(tmp_path):
    path = tmp_path / "notes.dcm"
    path.write_text("hello, this is not DICOM" * 20)
    err, msg = _fails(path)
    assert err.path == str(path) and "not a DICOM file" in msg


@pytest.mark.parametrize("keep", [0.03, 0.06, 0.5, 0.95])
def test_truncated_dicom(tmp_path, keep):
    good = save(make_dataset(ramp(64, 64)), tmp_path / "good.dcm")
    data = good.read_bytes()
    path = tmp_path / "cut.dcm"
    path.write_bytes(data[: int(len(data) * keep)])
    err, msg = _fails(path)
    assert err.path == str(path)
    assert "truncated" in msg


def test_no_pixel_data(tmp_path):
    ds = make_dataset(ramp())
    del ds.PixelData
    path = save(ds, tmp_path / "sr.dcm")
    err, msg = _fails(path)
    assert err.path == str(path) and "no pixel data" in msg


def test_unsupported_transfer_syntax_names_uid_and_name(tmp_path):
    ds = make_dataset(ramp())
    path = tmp_path / "h264.dcm"
    # MPEG-4 AVC video in DICOM: pydicom has no decoder for it
    from pydicom.encaps import encapsulate

    ds.PixelData = encapsulate([b"\x00\x00\x00\x01" + b"\x00" * 20])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = "1.2.840.10008.1.2.4.102"
    ds.save_as(path, enforce_file_format=True)
    err, msg = _fails(path, UnsupportedTransferSyntaxError)
    assert "1.2.840.10008.1.2.4.102" in msg and "MPEG-4 AVC/H.264" in msg
    assert err.code == "unsupported_transfer_syntax"


def test_unknown_transfer_syntax(tmp_path):
    ds = make_dataset(ramp())
    path = save(ds, tmp_path / "odd.dcm")
    # same length as "1.2.840.10008.1.2.1" + NUL pad, so the meta group length stays right
    data = path.read_bytes().replace(b"1.2.840.10008.1.2.1\x00", b"1.2.3.4.5.6.7.8.9.10", 1)
    path.write_bytes(data)
    err, msg = _fails(path, UnsupportedTransferSyntaxError)
    assert "1.2.3.4.5.6.7.8.9.10" in msg and str(path) in msg


def test_undecodable_compressed_data(tmp_path):
    from pydicom.encaps import encapsulate

    ds = make_dataset(ramp())
    ds.PixelData = encapsulate([b"\x00garbage, not a codestream" * 4])
    ds["PixelData"].VR = "OB"
    path = save(ds, tmp_path / "bad_j2k.dcm", JPEG2000Lossless)
    err, msg = _fails(path)
    assert str(path) in msg and "cannot decode" in msg and str(JPEG2000Lossless) in msg


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    err, msg = _fails(tmp_path / "empty")
    assert "empty" in msg and str(tmp_path / "empty") in msg


def test_folder_without_dicom(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "README").write_text("nothing here")
    err, msg = _fails(folder)
    assert "no DICOM image" in msg and err.path == str(folder)


def test_empty_zip(tmp_path):
    path = tmp_path / "e.zip"
    zipfile.ZipFile(path, "w").close()
    err, msg = _fails(path)
    assert "empty" in msg and err.path == str(path)


def test_not_a_zip(tmp_path):
    path = tmp_path / "x.zip"
    path.write_bytes(b"PK but not really")
    err, msg = _fails(path)
    assert "not a valid zip" in msg


def test_mixed_series_says_how_many(tmp_path):
    folder = tmp_path / "mixed"
    write_series(folder, n=2)
    write_series(folder / "other", n=2)
    save(make_dataset(ramp(8, 8)), folder / "third.dcm")
    err, msg = _fails(folder)
    assert "3 different series" in msg and err.path == str(folder)


def test_inconsistent_frame_sizes(tmp_path):
    folder = tmp_path / "sizes"
    folder.mkdir()
    study, series = generate_uid(), generate_uid()
    save(make_dataset(ramp(8, 8), study_uid=study, series_uid=series, instance=1), folder / "a.dcm")
    save(make_dataset(ramp(8, 12), study_uid=study, series_uid=series, instance=2), folder / "b.dcm")
    err, msg = _fails(folder)
    assert "inconsistent frame sizes" in msg and "b.dcm" in msg


@pytest.mark.parametrize("name", ["../evil.dcm", "/abs/evil.dcm", "a/../../evil.dcm"])
def test_zip_path_traversal(tmp_path, name):
    path = tmp_path / "t.zip"
    good = save(make_dataset(ramp()), tmp_path / "g.dcm")
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(good, "ok.dcm")
        zf.writestr(name, good.read_bytes())
    err, msg = _fails(path)
    assert "path traversal" in msg and err.path == str(path)


def test_pixel_limit(tmp_path):
    path = save(make_dataset(ramp(32, 32)), tmp_path / "big.dcm")
    err, msg = _fails(path, limits=IngestLimits(max_pixels=100))
    assert "exceeds the limit" in msg and err.path == str(path)


def test_file_limit(tmp_path):
    write_series(tmp_path / "s", n=3)
    err, msg = _fails(tmp_path / "s", limits=IngestLimits(max_files=2))
    assert "3 files exceed the limit of 2" in msg


def test_truncated_file_inside_a_series_is_named(tmp_path):
    # Was: the whole series failed, naming IM0001. The issue (item 3) asks that the series is still reported on
    # and the slice named by InstanceNumber, never by file name (file names of real exports carry patient names).
    folder = tmp_path / "s"
    write_series(folder, n=3, shuffle_names=False)
    victim = folder / "IM0001"  # InstanceNumber 2
    victim.write_bytes(victim.read_bytes()[:-40])
    study = load_study(folder)
    assert study.num_frames == 2
    (msg,) = study.warnings
    assert "InstanceNumber 2" in msg and "truncated" in msg and "IM0001" not in msg


def test_bad_limits_are_config_errors():
    from edgekit.errors import ConfigError

    with pytest.raises(ConfigError):
        IngestLimits(max_files=0)


def test_error_messages_hold_no_traceback_worthy_types(tmp_path):
    # Garbage of every size must still map to a StudyError, never an IndexError/struct.error from deep inside.
    rng = np.random.default_rng(0)
    for size in (0, 1, 131, 200, 1000):
        path = tmp_path / f"r{size}.dcm"
        data = bytes(128) + b"DICM" + rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        path.write_bytes(data)
        with pytest.raises(StudyError):
            load_study(path)
