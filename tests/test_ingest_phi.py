"""Patient data never reaches logs, warnings, Study.warnings, meta or error messages."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pydicom
import pytest
from pydicom import config

from edgekit.errors import StudyError
from edgekit.ingest import hash_uid, load_study, phi_guard
from edgekit.ingest.phi import scrub

from ingest_factory import PHI_DATE, PHI_ID, PHI_NAME, make_dataset, ramp, save

BAD_NAME = "Secretname^Johnathan" + "Q" * 70  # PN component over 64 chars: pydicom warns, quoting nothing
BAD_DATE = "1965-04-12"  # not DA format: pydicom warns and quotes the value
BAD_BIRTH = "19xx0412"


def _phi_file(tmp_path):
    ds = make_dataset(ramp(), window=(800, 1600))
    with config.disable_value_validation():
        ds.PatientName = BAD_NAME
        ds.PatientID = PHI_ID
        ds.StudyDate = BAD_DATE
        ds.PatientBirthDate = BAD_BIRTH
        ds.AccessionNumber = "ACC998877"
        return save(ds, tmp_path / "phi.dcm")


SECRETS = ("Secretname", "Johnathan", PHI_ID, BAD_DATE, BAD_BIRTH, "ACC998877", "19650412")


def _assert_clean(text: str):
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked into: {text[:200]}"


def test_hash_uid_format_and_stability():
    h = hash_uid("1.2.840.113619.2.55.3")
    assert h.startswith("uid:") and len(h) == 20 and int(h[4:], 16) >= 0
    assert h == hash_uid("1.2.840.113619.2.55.3\x00") == hash_uid(b"1.2.840.113619.2.55.3")
    assert h != hash_uid("1.2.840.113619.2.55.4")


def test_guard_scrubs_pydicom_warnings_and_logs(tmp_path, caplog, recwarn):
    path = _phi_file(tmp_path)
    caplog.set_level(logging.DEBUG)
    with phi_guard() as captured:
        ds = pydicom.dcmread(path)
        # Touching the elements makes pydicom validate them; setting one warns with the raw value quoted.
        _ = (ds.PatientName, ds.PatientID, ds.StudyDate, ds.PatientBirthDate)
        ds.StudyDate = BAD_DATE
        ds.PatientBirthDate = BAD_BIRTH
        logging.getLogger("pydicom").warning("value was %r", PHI_ID)
    assert captured.messages, "the guard must still report that something was wrong"
    assert any("redacted" in m for m in captured.messages)
    for m in captured.messages:
        _assert_clean(m)
    for record in caplog.records:
        _assert_clean(record.getMessage())
    for w in recwarn.list:
        _assert_clean(str(w.message))


def test_without_the_guard_pydicom_would_leak(tmp_path):
    # Proves the test above tests something: unguarded, the raw date reaches the warning text.
    ds = pydicom.dcmread(_phi_file(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds.StudyDate = BAD_DATE
    assert any(BAD_DATE in str(w.message) for w in caught)


def test_load_study_leaks_nothing(tmp_path, caplog, recwarn):
    path = _phi_file(tmp_path)
    caplog.set_level(logging.DEBUG)
    study = load_study(path)
    everything = " ".join([*study.warnings, repr(study.meta), study.uid_hash, study.modality])
    _assert_clean(everything)
    for record in caplog.records:
        _assert_clean(record.getMessage())
    for w in recwarn.list:
        _assert_clean(str(w.message))
    assert np.isfinite(study.frames).all()


def test_error_messages_leak_nothing(tmp_path, caplog, recwarn):
    ds = make_dataset(ramp())
    del ds.PixelData
    with config.disable_value_validation():
        ds.PatientName = BAD_NAME
        ds.PatientID = PHI_ID
        ds.StudyDate = BAD_DATE
        path = save(ds, tmp_path / "nopix.dcm")
    with pytest.raises(StudyError) as info:
        load_study(path)
    _assert_clean(str(info.value))
    for record in caplog.records:
        _assert_clean(record.getMessage())


def test_scrub_redacts_quoted_values_and_dates():
    text = "Invalid value for VR DA: '19650412' and PN \"Doe^John\" at 2023-01-01, id 1234567890"
    out = scrub(text)
    for secret in ("19650412", "Doe^John", "2023-01-01", "1234567890"):
        assert secret not in out
    assert "Invalid value for VR DA" in out
    assert scrub("name Smith^Ann here", ("Smith^Ann",)) == "name <redacted> here"


def test_name_in_pydicom_log_args_is_scrubbed(caplog):
    caplog.set_level(logging.DEBUG)
    with phi_guard():
        logging.getLogger("pydicom").error("Bad PN %s for %s", f"'{PHI_NAME}'", f"'{PHI_DATE}'")
    for record in caplog.records:
        _assert_clean(record.getMessage())
    assert any("redacted" in r.getMessage() for r in caplog.records)


def test_guards_in_two_threads_capture_only_their_own_warnings():
    """The guard keeps no process-wide lock: two ingests run side by side, and each study gets its own notes."""
    import threading

    barrier = threading.Barrier(2)
    results: dict[int, list[str]] = {}

    def ingest(k: int) -> None:
        with phi_guard() as captured:
            barrier.wait()  # both inside their guards at once
            for i in range(50):
                warnings.warn(f"note {i} of study {k} about '{PHI_NAME}'", UserWarning, stacklevel=1)
                logging.getLogger("pydicom").warning("logged note of study %d", k)
            barrier.wait()
        results[k] = captured.messages

    threads = [threading.Thread(target=ingest, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for k, other in ((1, 2), (2, 1)):
        assert len([m for m in results[k] if m.startswith("note ")]) == 50  # repeated notes are all kept
        assert any(f"logged note of study {k}" in m for m in results[k])
        assert not any(f"study {other}" in m for m in results[k]), "a note went to the other thread's study"
        for m in results[k]:
            _assert_clean(m)
