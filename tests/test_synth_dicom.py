"""Synthetic studies as files: valid DICOM in every transfer syntax, decoding back to the generated pixels, and
the cine loop as an MP4 that PyAV decodes frame for frame."""

import warnings

import numpy as np
import pydicom
import pytest
from pydicom.uid import (
    UID,
    ComputedRadiographyImageStorage,
    CTImageStorage,
    DeflatedExplicitVRLittleEndian,
    DigitalXRayImageStorageForPresentation,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    MRImageStorage,
    RLELossless,
    UltrasoundMultiFrameImageStorage,
)

from edgekit.errors import StudyError
from edgekit.models.synth import generate_study
from edgekit.models.synth.dicom_writer import verify_dicom, write_dicom
from edgekit.models.synth.video_writer import read_mp4_gray, write_mp4

LOSSLESS = [
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    DeflatedExplicitVRLittleEndian,
    RLELossless,
    JPEG2000Lossless,
]
SOP = {
    "CT": CTImageStorage,
    "MR": MRImageStorage,
    "CR": ComputedRadiographyImageStorage,
    "DX": DigitalXRayImageStorageForPresentation,
    "US": UltrasoundMultiFrameImageStorage,
}


def _read(paths):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning on read would mean a malformed element
        dss = [pydicom.dcmread(p) for p in paths]
        arrays = [ds.pixel_array for ds in dss]
    return dss, arrays


@pytest.mark.parametrize("kind_offset", [0, 1, 2], ids=["ct", "mr", "cr"])
@pytest.mark.parametrize("syntax", LOSSLESS, ids=lambda u: u.name)
def test_lossless_syntaxes_decode_exactly(tmp_path, kind_offset, syntax):
    study = generate_study(kind_offset, "test")
    paths = write_dicom(study, tmp_path, syntax=syntax, verify=False)
    dss, arrays = _read(paths)
    decoded = np.stack(arrays).reshape(study.stored.shape)
    assert decoded.dtype == study.stored.dtype
    assert np.array_equal(decoded, study.stored)
    assert all(ds.file_meta.TransferSyntaxUID == syntax for ds in dss)


@pytest.mark.parametrize(
    "syntax", [JPEGBaseline8Bit, RLELossless, JPEG2000Lossless, ExplicitVRLittleEndian], ids=lambda u: u.name
)
def test_us_cine_syntaxes(tmp_path, syntax):
    study = generate_study(3, "test")
    (path,) = write_dicom(study, tmp_path, syntax=syntax, verify=False)
    (ds,), (arr,) = _read([path])
    assert arr.shape == study.stored.shape and int(ds.NumberOfFrames) == study.num_frames
    err = np.abs(arr.astype(np.int32) - study.stored.astype(np.int32))
    if syntax == JPEGBaseline8Bit:
        assert err.mean() < 3.0 and ds.LossyImageCompression == "01"
    else:
        assert err.max() == 0


def test_attributes_geometry_and_uids(tmp_path):
    for index in range(4):  # CT, MR, CR/DX, US
        s = generate_study(index, "test")
        paths = write_dicom(s, tmp_path / s.id)
        dss, _ = _read(paths)
        for ds in dss:
            assert ds.SOPClassUID == SOP[s.modality] and ds.Modality == s.modality
            assert [float(v) for v in ds.PixelSpacing] == list(s.pixel_spacing)
            assert ds.StudyInstanceUID == s.study_uid and ds.SeriesInstanceUID == s.series_uid
            for uid in (ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.SOPInstanceUID):
                assert UID(uid).is_valid
            assert float(ds.WindowCenter) == s.center and float(ds.WindowWidth) == s.width
            assert ds.PhotometricInterpretation == s.photometric
            assert str(ds.PatientName) == s.patient["PatientName"] and ds.PatientBirthDate
        assert len({ds.SOPInstanceUID for ds in dss}) == len(dss)
        if s.modality == "CT":
            assert float(dss[0].RescaleIntercept) == -1024 and float(dss[0].RescaleSlope) == 1
        if s.modality in ("CT", "MR"):
            z = [float(ds.ImagePositionPatient[2]) for ds in dss]
            assert [int(ds.InstanceNumber) for ds in dss] == list(range(1, len(dss) + 1))
            assert np.all(np.diff(z) > 0)  # slices ordered feet to head, as ingest sorts them


def test_files_are_byte_identical_when_rewritten(tmp_path):
    for index in (0, 3):
        s = generate_study(index, "val")
        a = write_dicom(s, tmp_path / "a", verify=False)
        b = write_dicom(generate_study(index, "val"), tmp_path / "b", verify=False)
        assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_verify_catches_wrong_pixels(tmp_path):
    s = generate_study(0, "test")
    paths = write_dicom(s, tmp_path, verify=False)
    s.stored = s.stored.copy()
    s.stored[0, 0, 0] += 1
    with pytest.raises(StudyError):
        verify_dicom(s, paths)


def test_mp4_decodes_to_every_frame(tmp_path):
    s = generate_study(3, "test")
    path = write_mp4(s.stored, tmp_path / "cine.mp4", s.fps)
    frames = read_mp4_gray(path)
    assert frames.shape == s.stored.shape
    assert np.abs(frames.astype(np.int32) - s.stored.astype(np.int32)).mean() < 4.0
    again = write_mp4(s.stored, tmp_path / "again.mp4", s.fps)
    assert path.read_bytes() == again.read_bytes()
    import av

    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.name == "mpeg4"
