"""load_study on DICOM files, series folders and zips: decoding, windowing, ordering (docs/interfaces.md, Studies)."""

from __future__ import annotations

import zipfile

import numpy as np
import pydicom.pixels as px
import pytest
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEGLSLossless,
    RLELossless,
    generate_uid,
)

from edgekit.ingest import IngestLimits, hash_uid, load_study, to_display

from ingest_factory import make_dataset, ramp, save, save_pillow_compressed, write_series


def _expected(pixels, **kw):
    return to_display(pixels, **kw)


@pytest.mark.parametrize("ts", [ExplicitVRLittleEndian, ImplicitVRLittleEndian, DeflatedExplicitVRLittleEndian])
def test_uncompressed_transfer_syntaxes(tmp_path, ts):
    pixels = ramp()
    ds = make_dataset(pixels, window=(400, 1000), slope=1.0, intercept=-100.0)
    path = save(ds, tmp_path / "a.dcm", ts)
    study = load_study(path)
    np.testing.assert_allclose(study.frames[0], _expected(pixels, intercept=-100, center=400, width=1000), atol=1e-6)
    assert study.frames.shape == (1, 16, 16) and study.frames.dtype == np.float32
    assert study.source == "dicom" and study.modality == "CT"
    assert study.meta["transfer_syntax"] == str(ts)
    assert study.uid_hash == hash_uid(ds.StudyInstanceUID)


def test_rle_lossless(tmp_path):
    pixels = ramp()
    ds = make_dataset(pixels, window=(800, 1600))
    ds.compress(RLELossless, pixels, encoding_plugin="pydicom")
    study = load_study(save(ds, tmp_path / "rle.dcm"))
    np.testing.assert_allclose(study.frames[0], _expected(pixels, center=800, width=1600), atol=1e-6)
    assert study.meta["transfer_syntax_name"] == "RLE Lossless"


def test_jpeg2000_lossless(tmp_path):
    pixels = ramp(dtype=np.uint16, scale=13)
    ds = make_dataset(pixels, window=(1500, 3000))
    study = load_study(save_pillow_compressed(ds, pixels, tmp_path / "j2k.dcm", "j2k"))
    np.testing.assert_allclose(study.frames[0], _expected(pixels, center=1500, width=3000), atol=1e-6)


def test_jpeg_baseline_is_close(tmp_path):
    pixels = ramp(dtype=np.uint8, scale=1)
    ds = make_dataset(pixels)
    study = load_study(save_pillow_compressed(ds, pixels, tmp_path / "jpg.dcm", "jpeg"))
    assert np.abs(study.frames[0] - _expected(pixels)).max() < 0.06


def test_jpeg_ls_lossless(tmp_path):
    if not px.get_encoder(JPEGLSLossless).is_available:
        pytest.skip("no JPEG-LS encoder")
    pixels = ramp()
    ds = make_dataset(pixels, window=(800, 1600))
    ds.compress(JPEGLSLossless, pixels)
    study = load_study(save(ds, tmp_path / "jls.dcm"))
    np.testing.assert_allclose(study.frames[0], _expected(pixels, center=800, width=1600), atol=1e-6)


def test_multi_valued_window_uses_the_first(tmp_path):
    pixels = ramp()
    ds = make_dataset(pixels)
    ds.WindowCenter = [500, 40]
    ds.WindowWidth = [900, 80]
    study = load_study(save(ds, tmp_path / "w.dcm"))
    np.testing.assert_allclose(study.frames[0], _expected(pixels, center=500, width=900), atol=1e-6)


def test_no_window_is_min_max(tmp_path):
    pixels = ramp(offset=50)
    study = load_study(save(make_dataset(pixels), tmp_path / "m.dcm"))
    assert study.frames.min() == 0.0 and study.frames.max() == 1.0


def test_monochrome1_is_inverted(tmp_path):
    pixels = ramp()
    m1 = load_study(save(make_dataset(pixels, photometric="MONOCHROME1", window=(800, 1600)), tmp_path / "m1.dcm"))
    m2 = load_study(save(make_dataset(pixels, window=(800, 1600)), tmp_path / "m2.dcm"))
    np.testing.assert_allclose(m1.frames, 1.0 - m2.frames, atol=1e-6)
    assert m1.frames[0, 0, 0] > m1.frames[0, -1, -1]


def test_signed_pixels_with_rescale(tmp_path):
    pixels = (ramp(dtype=np.int16) - 800).astype(np.int16)
    ds = make_dataset(pixels, slope=2.0, intercept=-1024.0, window=(-1000, 1500))
    study = load_study(save(ds, tmp_path / "s.dcm"))
    np.testing.assert_allclose(
        study.frames[0], _expected(pixels, slope=2.0, intercept=-1024.0, center=-1000, width=1500), atol=1e-6
    )


def test_rgb_object_becomes_luminance(tmp_path):
    rgb = np.zeros((8, 8, 3), dtype=np.uint8)
    rgb[..., 0] = 200
    rgb[:4, :, 1] = 100
    study = load_study(save(make_dataset(rgb, photometric="RGB", modality="US"), tmp_path / "rgb.dcm"))
    assert study.frames.shape == (1, 8, 8) and study.modality == "US"
    assert study.frames[0, 0, 0] == pytest.approx(1.0) and study.frames[0, -1, -1] == pytest.approx(0.0)


def test_multi_frame_keeps_frame_order(tmp_path):
    stack = np.stack([np.full((8, 8), v, dtype=np.uint16) for v in (5, 50, 20, 90)])
    ds = make_dataset(stack, modality="US", window=(50, 101))
    ds.FrameTime = 40.0
    study = load_study(save(ds, tmp_path / "mf.dcm"))
    assert study.frames.shape == (4, 8, 8)
    means = study.frames.mean(axis=(1, 2))
    assert np.argsort(means).tolist() == [0, 2, 1, 3]
    assert study.meta["fps"] == pytest.approx(25.0) and study.meta["number_of_frames"] == 4


def test_series_is_sorted_along_the_slice_normal(tmp_path):
    _, values = write_series(tmp_path / "series", n=6)
    study = load_study(tmp_path / "series")
    means = study.frames.mean(axis=(1, 2))
    assert np.all(np.diff(means) > 0), "slices must follow z, not file names or InstanceNumber"
    assert study.meta["number_of_files"] == 6
    assert study.meta["slice_spacing"] == pytest.approx(2.5)
    # min-max over the whole series, not per slice
    assert means[0] == pytest.approx(0.0) and means[-1] == pytest.approx(1.0)


def test_series_normal_accounts_for_orientation(tmp_path):
    # sagittal: rows along +y, columns along -z => normal (row x col) along -x; z positions are noise
    folder = tmp_path / "sag"
    folder.mkdir()
    study_uid, series_uid = generate_uid(), generate_uid()
    for k, x in enumerate([3.0, -1.0, 7.0]):
        ds = make_dataset(
            np.full((4, 4), int(x * 10 + 100), dtype=np.uint16),
            study_uid=study_uid,
            series_uid=series_uid,
            orientation=(0, 1, 0, 0, 0, -1),
            position=(x, 0.0, 50.0 - k),
            instance=k + 1,
        )
        save(ds, folder / f"f{k}.dcm")
    means = load_study(folder).frames.mean(axis=(1, 2))
    assert np.all(np.diff(means) < 0), "ascending along -x means descending x"


def test_series_without_positions_uses_instance_number(tmp_path):
    folder = tmp_path / "noipp"
    folder.mkdir()
    study_uid, series_uid = generate_uid(), generate_uid()
    for inst, name in [(3, "a"), (1, "b"), (2, "c")]:
        ds = make_dataset(
            np.full((4, 4), inst * 10, dtype=np.uint16),
            study_uid=study_uid,
            series_uid=series_uid,
            orientation=None,
            instance=inst,
        )
        save(ds, folder / name)
    means = load_study(folder).frames.mean(axis=(1, 2))
    assert np.all(np.diff(means) > 0)


def test_zip_of_a_series_matches_the_folder(tmp_path):
    write_series(tmp_path / "s", n=4)
    archive = tmp_path / "s.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for p in sorted((tmp_path / "s").iterdir()):
            zf.write(p, f"export/{p.name}")
    a = load_study(tmp_path / "s")
    b = load_study(archive)
    np.testing.assert_array_equal(a.frames, b.frames)
    assert a.uid_hash == b.uid_hash


def test_stray_files_are_skipped_with_a_warning(tmp_path):
    folder = tmp_path / "series"
    write_series(folder, n=3)
    (folder / "README").write_text("exported by a PACS")
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    ds = make_dataset(np.zeros((4, 4), dtype=np.uint16))
    from pydicom.uid import MediaStorageDirectoryStorage

    ds.file_meta.MediaStorageSOPClassUID = MediaStorageDirectoryStorage
    del ds.PixelData
    save(ds, folder / "DICOMDIR")
    study = load_study(folder)
    assert study.num_frames == 3
    assert any("README" in w for w in study.warnings)
    assert any(".DS_Store" in w for w in study.warnings)
    assert not any("DICOMDIR" in w for w in study.warnings)


def test_frame_limit(tmp_path):
    write_series(tmp_path / "s", n=4)
    with pytest.raises(Exception) as info:
        load_study(tmp_path / "s", limits=IngestLimits(max_frames=3))
    assert "limit" in str(info.value) and str(tmp_path / "s") in str(info.value)


def test_enhanced_multi_frame_functional_groups(tmp_path):
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    stack = np.stack([np.full((8, 8), v, dtype=np.uint16) for v in (100, 300, 200)])
    ds = make_dataset(stack, modality="MR")
    voi = Dataset()
    voi.WindowCenter, voi.WindowWidth = 200, 201
    pvt = Dataset()
    pvt.RescaleSlope, pvt.RescaleIntercept = 1.0, 0.0
    orient = Dataset()
    orient.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
    shared = Dataset()
    shared.FrameVOILUTSequence = Sequence([voi])
    shared.PixelValueTransformationSequence = Sequence([pvt])
    shared.PlaneOrientationSequence = Sequence([orient])
    ds.SharedFunctionalGroupsSequence = Sequence([shared])
    del ds.ImageOrientationPatient
    study = load_study(save(ds, tmp_path / "enh.dcm"))
    np.testing.assert_allclose(study.frames, to_display(stack, center=200, width=201), atol=1e-6)
    assert study.modality == "MR"


def test_voi_lut_sequence_is_applied(tmp_path):
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    pixels = np.arange(16, dtype=np.uint16).reshape(4, 4) * 16  # 0..240
    ds = make_dataset(pixels)
    lut = Dataset()
    lut.LUTDescriptor = [256, 0, 8]
    table = (255 - np.arange(256)).astype(np.uint16)  # an inverting LUT makes the effect unmistakable
    lut.add_new(0x00283006, "US", table.tolist())  # LUTData as US (explicit VR), so pydicom writes a list
    ds.VOILUTSequence = Sequence([lut])
    study = load_study(save(ds, tmp_path / "lut.dcm"))
    np.testing.assert_allclose(study.frames[0], (255 - pixels) / 255.0, atol=1e-6)
