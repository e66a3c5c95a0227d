"""JPEG 2000 through Pillow's OpenJPEG at the thread count edgekit sets: the same pixels as pydicom's first choice
(GDCM), a frame Pillow declines still decoded by the others, the CPUs shared among studies decoding at once, and a
deployment's own OPJ_NUM_THREADS kept, in this process and in the processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pydicom
import pydicom.pixels as px
import pytest
from pydicom.uid import JPEG2000, JPEG2000Lossless

from edgekit.cpus import cpu_budget
from edgekit.ingest import IngestLimits, load_study
from edgekit.ingest import workers as workers_module
from edgekit.ingest.decode_threads import THREADS_ENV, decode_threads
from edgekit.ingest.workers import IngestWorkers

SAMPLE = Path(__file__).resolve().parents[1] / "models" / "samples" / "cr_chest" / "image.dcm"


def _gdcm_frames(path: Path) -> np.ndarray:
    """GDCM's decode (python-gdcm is a core dependency: a missing one fails here, not skips)."""
    return px.pixel_array(pydicom.dcmread(path), decoding_plugin="gdcm")


def _lossy_copy(tmp_path: Path, ratio: int = 20) -> Path:
    ds = pydicom.dcmread(SAMPLE)
    ds.compress(JPEG2000, px.pixel_array(ds), encoding_plugin="pylibjpeg", j2k_cr=[ratio])
    ds.save_as(tmp_path / "lossy.dcm", enforce_file_format=True)
    return tmp_path / "lossy.dcm"


@pytest.mark.parametrize("ratio", [None, 5, 20, 80], ids=["lossless", "lossy-5", "lossy-20", "lossy-80"])
def test_jpeg2000_study_has_gdcms_pixels(tmp_path, ratio):
    """The study's display frames are what GDCM's stored values make: load_study against the same study re-encoded
    uncompressed from GDCM's decode."""
    path = _lossy_copy(tmp_path, ratio) if ratio else SAMPLE
    ds = pydicom.dcmread(path)
    assert ds.file_meta.TransferSyntaxUID == (JPEG2000 if ratio else JPEG2000Lossless)
    stored = _gdcm_frames(path)
    ds.PixelData = stored.astype("<u2").tobytes()
    ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds.save_as(tmp_path / "native.dcm", enforce_file_format=True)
    ours, gdcms = load_study(path).frames, load_study(tmp_path / "native.dcm").frames
    if ratio is None:
        assert np.array_equal(ours, gdcms)
    else:  # the irreversible wavelet is floating point: two OpenJPEG builds may round a value apart (here they agree)
        np.testing.assert_allclose(ours, gdcms, atol=1.5 / 4095)


def test_frame_pillow_declines_is_decoded_by_the_others(tmp_path):
    """Pillow refuses 12-bit colour JPEG 2000; pydicom's other plugins decode it: the study is the one its pixels
    make uncompressed."""
    ds = pydicom.dcmread(SAMPLE)
    grey = px.pixel_array(ds)
    rgb = np.stack([grey, grey // 2, grey // 3], axis=-1).astype(np.uint16)
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.compress(JPEG2000Lossless, rgb, encoding_plugin="pylibjpeg")
    ds.save_as(tmp_path / "rgb12.dcm", enforce_file_format=True)
    with pytest.raises(Exception, match="12-bit multi-sample"):
        px.pixel_array(ds, decoding_plugin="pillow")
    ds.PixelData = rgb.astype("<u2").tobytes()
    ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds.save_as(tmp_path / "native.dcm", enforce_file_format=True)
    study = load_study(tmp_path / "rgb12.dcm")
    assert np.array_equal(study.frames, load_study(tmp_path / "native.dcm").frames)
    assert study.warnings == []  # declined up front: no plugin failed, so pydicom logged nothing


def test_a_frame_pillow_fails_on_is_gdcms_without_a_word(tmp_path, caplog):
    """pydicom's GDCMJ2K_TextGBR.dcm: Pillow's OpenJPEG stops at "broken data stream", GDCM decodes it. The study
    is GDCM's, and Pillow's failure is neither a study warning nor a log line."""
    from pydicom.data import get_testdata_file

    path = Path(get_testdata_file("GDCMJ2K_TextGBR.dcm", download=False))  # shipped inside pydicom's wheel
    with pytest.raises(Exception, match="broken data stream"):
        px.pixel_array(pydicom.dcmread(path), decoding_plugin="pillow")
    ds = pydicom.dcmread(path)
    ds.PixelData = (
        _gdcm_frames(path).astype(f"<{'i' if ds.PixelRepresentation else 'u'}{ds.BitsAllocated // 8}").tobytes()
    )
    ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds.save_as(tmp_path / "native.dcm", enforce_file_format=True)
    caplog.set_level("DEBUG")
    caplog.clear()  # the check above logged Pillow's failure itself
    study = load_study(path)
    assert study.warnings == []
    assert not [r for r in caplog.records if "broken data stream" in r.getMessage()]
    assert np.array_equal(study.frames, load_study(tmp_path / "native.dcm").frames)


def test_cpus_are_shared_among_studies_decoding_at_once():
    cpus = cpu_budget().usable  # the affinity, within a CPU quota where the machine has one
    assert decode_threads() == decode_threads(1) == cpus
    assert decode_threads(2) == max(1, cpus // 2)
    assert decode_threads(cpus + 1) == 1
    assert decode_threads(0) == cpus


def test_studies_decoded_side_by_side_in_workers_match_in_process(tmp_path):
    lossy = _lossy_copy(tmp_path)
    pool = IngestWorkers(2, timeout_s=60)
    try:
        results: dict[str, np.ndarray] = {}

        def load(name: str, path: Path) -> None:
            for _ in range(3):
                results[name] = pool.load(path, IngestLimits()).frames.copy()

        threads = [threading.Thread(target=load, args=(n, p)) for n, p in (("lossless", SAMPLE), ("lossy", lossy))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        pool.close()
    assert np.array_equal(results["lossless"], load_study(SAMPLE).frames)
    assert np.array_equal(results["lossy"], load_study(lossy).frames)


def _detector_sized(tmp_path: Path, size: int = 2048) -> Path:
    """The sample scaled to a detector's size and encoded again, JPEG 2000 lossless: long enough a decode (hundreds
    of ms) to watch the decoding process's threads."""
    from PIL import Image

    ds = pydicom.dcmread(SAMPLE)
    frame = Image.fromarray(px.pixel_array(ds).astype(np.float32)).resize((size, size), Image.Resampling.BILINEAR)
    ds.Rows = ds.Columns = size
    ds.compress(JPEG2000Lossless, np.clip(np.asarray(frame), 0, 4095).astype(np.uint16), encoding_plugin="pylibjpeg")
    ds.save_as(tmp_path / "big.dcm", enforce_file_format=True)
    return tmp_path / "big.dcm"


@pytest.mark.skipif(cpu_budget().usable < 2, reason="one usable CPU: a study alone decodes on one thread anyway")
def test_a_study_alone_in_a_worker_decodes_on_every_cpu(tmp_path):
    """The pool's hint reaches the worker: while a lone study decodes, its process runs OpenJPEG's extra threads
    (none run when OpenJPEG has one thread)."""
    big = _detector_sized(tmp_path)
    pool = IngestWorkers(1, timeout_s=120)
    try:
        pool.load(SAMPLE, IngestLimits())  # the worker started, idle
        (pid,) = pool.pids()
        idle = len(os.listdir(f"/proc/{pid}/task"))
        done = threading.Event()
        most = idle

        def load() -> None:
            try:
                pool.load(big, IngestLimits())
            finally:
                done.set()

        t = threading.Thread(target=load)
        t.start()
        while not done.is_set():
            most = max(most, len(os.listdir(f"/proc/{pid}/task")))
            time.sleep(0.001)
        t.join()
    finally:
        pool.close()
    assert most >= idle + 2


def test_a_worker_takes_a_request_without_a_thread_hint():
    """Mid-upgrade, a daemon still running the old code starts a worker from the new files and sends (path, limits)."""
    worker = workers_module._Worker.start()
    try:
        worker.conn.send((str(SAMPLE), IngestLimits()))
        kind, *_ = worker.conn.recv()
        while kind == "cost":
            worker.conn.send(True)
            kind, *_ = worker.conn.recv()
        assert kind == "done"
    finally:
        worker.stop()


PROBE = """
import json, os
from edgekit.ingest import decode_threads as dt
from edgekit.cli.app import main
main(["--version"])
seen = os.environ.get(dt.THREADS_ENV)
child = dt.child_env(dict(os.environ)).get(dt.THREADS_ENV)
dt.set_threads(1)
after = os.environ.get(dt.THREADS_ENV)
os.environ[dt.THREADS_ENV] = "5"  # the deployment's, set after edgekit's (a notebook, a test's monkeypatch)
dt.set_threads(1)
print(json.dumps([seen, child, after, os.environ[dt.THREADS_ENV], dt.child_env(dict(os.environ))[dt.THREADS_ENV]]))
"""


def _probe(env: dict[str, str]) -> list:
    import json

    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_cli_gives_a_study_every_cpu_and_keeps_it_from_its_children():
    env = {k: v for k, v in os.environ.items() if k != THREADS_ENV}
    cpus = str(cpu_budget().usable)
    assert _probe(env) == [cpus, None, "1", "5", "5"]


def test_a_deployments_own_setting_is_kept():
    assert _probe({**os.environ, THREADS_ENV: "3"}) == ["3", "3", "3", "5", "5"]
