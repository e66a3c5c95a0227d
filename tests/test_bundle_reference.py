"""A bundle's own reference outputs (edgekit/reference.py): `edgekit build` writes `reference.json` (the greedy
tokens of the just-built bundle on the packaged sample study, with the study's frames and the tolerance) under the
manifest; the bundle, loaded again, writes the same tokens; one whose weights were altered and re-manifested (every
checksum passes) is refused naming the file and the first position that differs; one built before the file
existed passes with a note."""

from __future__ import annotations

import json

import pytest
from bundle_tamper import altered_embeddings, rewrite

from edgekit.bundle import load_bundle, sha256_file
from edgekit.reference import (
    NO_REFERENCE,
    OTHER_ENGINE_TOKENS,
    REFERENCE_FILE,
    REFERENCE_ROLE,
    ReferenceMismatchError,
    check_reference,
    first_difference,
)


def _reporter(bundle, engine: str | None = None):
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    return Reporter.from_bundle(bundle, runtime=RuntimeOptions(threads=1, engine=engine))


def test_a_built_bundle_carries_its_reference_under_the_manifest(tiny_orin_bundles):
    orin, cpu = tiny_orin_bundles
    b = load_bundle(cpu)
    entry = b.manifest.components[REFERENCE_ROLE]
    path = b.component(REFERENCE_ROLE)
    assert entry.path == REFERENCE_FILE and entry.sha256 == sha256_file(path)  # the signature covers it
    doc = json.loads(path.read_text())
    assert doc["engine"] == "onnxruntime" and doc["target"] == "cpu"
    (case,) = doc["cases"]
    assert case["kind"] == "study" and case["modality"] == "DX" and case["frames"]["shape"] == [1, 256, 256]
    assert 0 < len(case["token_ids"]) <= case["max_new_tokens"]
    reporter = _reporter(b)
    try:
        assert check_reference(reporter, "onnxruntime") == {
            "checked": True,
            "cases": 1,
            "tokens_compared": len(case["token_ids"]),
            "engine": "onnxruntime",
            "reference_engine": "onnxruntime",
        }
    finally:
        reporter.close()
    # orin: made in ONNX Runtime (its engines' reference, runnable anywhere); on TensorRT the first tokens count
    o = load_bundle(orin)
    assert json.loads(o.component(REFERENCE_ROLE).read_text())["engine"] == "onnxruntime"
    reporter = _reporter(o, "onnxruntime")
    try:
        out = check_reference(reporter, "tensorrt")
    finally:
        reporter.close()
    assert out["tokens_compared"] == OTHER_ENGINE_TOKENS and out["reference_engine"] == "onnxruntime"


def test_altered_weights_re_manifested_are_refused_by_the_reference(tiny_orin_bundles, tmp_path):
    _, cpu = tiny_orin_bundles
    bad = rewrite(cpu, tmp_path / "bad", replace={"embed_tokens": altered_embeddings(cpu, tmp_path / "w")})
    b = load_bundle(bad)  # every checksum passes: the manifest was written again
    reporter = _reporter(b)
    try:
        with pytest.raises(ReferenceMismatchError, match=r"reference\.json: case 'sample study cr_chest' differs "):
            check_reference(reporter, "onnxruntime")
    finally:
        reporter.close()


def test_a_bundle_without_the_file_passes_with_a_note(tiny_orin_bundles, tmp_path):
    _, cpu = tiny_orin_bundles
    old = load_bundle(rewrite(cpu, tmp_path / "old", drop=(REFERENCE_ROLE,)))
    reporter = _reporter(old)
    try:
        assert check_reference(reporter, "onnxruntime") == {"checked": False, "note": NO_REFERENCE}
    finally:
        reporter.close()


def test_the_first_difference_counts_an_early_end():
    assert first_difference([1, 2, 3], [1, 2, 3], 3) is None
    assert first_difference([1, 9, 3], [1, 2, 3], 3) == 1
    assert first_difference([1, 9, 3], [1, 2, 3], 1) is None  # only the first token must match
    assert first_difference([1], [1, 2, 3], 3) == 1  # the output ended early
