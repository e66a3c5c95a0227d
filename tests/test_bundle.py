"""Bundles: round trip, every kind of corruption named precisely, newer schema, archives, atomic writes."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from edgekit.bundle import (
    MANIFEST_NAME,
    REQUIRED_ROLES,
    SCHEMA_VERSION,
    load_bundle,
    pack_bundle,
    sha256_file,
    unpack_bundle,
    verify_dir,
    write_bundle,
)
from edgekit.bundle import io as bundle_io
from edgekit.errors import BundleError

FILES = {
    "vision_encoder": ("vision_encoder.onnx", b"\x08\x07vision" * 300),
    "embed_tokens": ("embed_tokens.onnx", b"\x08\x07embed" * 200),
    "decoder": ("decoder_model_merged.onnx", b"\x08\x07decoder" * 500),
    "tokenizer": ("tokenizer.json", b'{"model": {"type": "BPE"}}'),
    "generation_config": ("generation_config.json", b'{"max_new_tokens": 64}'),
    "preprocessor_config": ("preprocessor_config.json", b'{"image_size": 64}'),
    "model_config": ("config.json", b'{"hidden": 32}'),
}
PROVENANCE = {"source_weights_sha256": "ab" * 32, "passes": [{"name": "fp16", "params": {"keep_io": True}}]}
FIGURES = {"parity": {"max_abs_logit_diff": 1.5e-5, "source": "tests/parity on 8 studies"}}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def sources(tmp_path) -> dict[str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    out = {}
    for role, (name, data) in FILES.items():
        (src / name).write_bytes(data)
        out[role] = src / name
    return out


def _write(tmp_path, sources, **kw) -> Path:
    return write_bundle(
        tmp_path / "bundle", sources, name="radreport-tiny", target="cpu", provenance=PROVENANCE, figures=FIGURES, **kw
    )


def test_round_trip(tmp_path, sources):
    out = _write(tmp_path, sources)
    bundle = load_bundle(out)
    assert bundle.name == "radreport-tiny" and bundle.target == "cpu"
    assert sorted(bundle.roles) == sorted(REQUIRED_ROLES)
    for role, (name, data) in FILES.items():
        assert bundle.component(role).read_bytes() == data
        assert bundle.component(role).name == name
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["schema_version"] == SCHEMA_VERSION
    assert m["components"]["decoder"]["sha256"] == sha256_file(sources["decoder"])
    assert m["components"]["decoder"]["bytes"] == len(FILES["decoder"][1])
    assert m["provenance"]["source_weights_sha256"] == "ab" * 32
    assert m["provenance"]["passes"][0]["name"] == "fp16"
    assert {"python", "edgekit", "numpy"} <= set(m["provenance"]["tools"])
    assert m["figures"]["size"]["bytes"] == sum(len(d) for _, d in FILES.values())
    assert "size_bytes" not in m["figures"]  # stated once
    assert m["figures"]["parity"]["source"]
    assert m["created"].endswith("+00:00")
    with pytest.raises(BundleError, match="no 'lora' component"):
        bundle.component("lora")


def test_a_staging_bundle_links_its_components_and_a_shipped_one_copies_them(tmp_path, sources):
    """The build's staging copy (`link=True`) holds the component files themselves (hard links: the model's
    bytes are written once per build); a shipped bundle holds copies, whatever happens to the sources after."""
    staged = _write(tmp_path, sources, link=True)
    shipped = write_bundle(tmp_path / "shipped", sources, name="radreport-tiny", target="cpu", figures=FIGURES)
    for role, src in sources.items():
        assert load_bundle(staged).component(role).stat().st_ino == src.stat().st_ino
        assert load_bundle(shipped).component(role).stat().st_ino != src.stat().st_ino
    verify_dir(staged)
    (tmp_path / "src" / FILES["decoder"][0]).write_bytes(b"changed")
    verify_dir(shipped)


def test_corrupt_byte_is_a_checksum_mismatch(tmp_path, sources):
    out = _write(tmp_path, sources)
    target = out / "decoder_model_merged.onnx"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(BundleError) as info:
        load_bundle(out)
    assert "checksum mismatch" in str(info.value) and info.value.path == str(target)


def test_truncated_file(tmp_path, sources):
    out = _write(tmp_path, sources)
    target = out / "vision_encoder.onnx"
    target.write_bytes(target.read_bytes()[:-10])
    with pytest.raises(BundleError) as info:
        load_bundle(out)
    assert "truncated" in str(info.value) and "vision_encoder.onnx" in str(info.value)


def test_missing_file(tmp_path, sources):
    out = _write(tmp_path, sources)
    (out / "tokenizer.json").unlink()
    with pytest.raises(BundleError) as info:
        load_bundle(out)
    assert "missing component file" in str(info.value) and "tokenizer.json" in str(info.value)


def test_missing_required_role_in_manifest(tmp_path, sources):
    out = _write(tmp_path, sources)
    m = json.loads((out / MANIFEST_NAME).read_text())
    del m["components"]["tokenizer"]
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(BundleError, match="lacks required component.*tokenizer"):
        load_bundle(out)


def test_write_requires_every_role(tmp_path, sources):
    del sources["decoder"]
    with pytest.raises(BundleError, match="missing required component.*decoder"):
        _write(tmp_path, sources)
    assert not (tmp_path / "bundle").exists()


def test_newer_schema(tmp_path, sources):
    out = _write(tmp_path, sources)
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["schema_version"] = SCHEMA_VERSION + 1
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(BundleError, match="written by a newer edgekit"):
        load_bundle(out)


@pytest.mark.parametrize(
    "text,reason", [("{nope", "not valid JSON"), ("[]", "not a JSON object"), ('{"schema_version": 1}', "'name'")]
)
def test_bad_manifest(tmp_path, sources, text, reason):
    out = _write(tmp_path, sources)
    (out / MANIFEST_NAME).write_text(text)
    with pytest.raises(BundleError, match=reason) as info:
        load_bundle(out)
    assert info.value.path == str(out / MANIFEST_NAME)


def test_manifest_path_outside_bundle_is_rejected(tmp_path, sources):
    out = _write(tmp_path, sources)
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["components"]["decoder"]["path"] = "../src/decoder_model_merged.onnx"
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(BundleError, match="invalid path"):
        load_bundle(out)


def test_not_a_bundle(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(BundleError, match="no manifest.json"):
        load_bundle(tmp_path / "plain")
    (tmp_path / "x.ekb").write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="not a bundle"):
        load_bundle(tmp_path / "x.ekb")
    with pytest.raises(BundleError, match="no such bundle"):
        load_bundle(tmp_path / "nothing")


def test_archive_form(tmp_path, sources):
    ekb = _write(tmp_path, sources, archive=True)
    assert ekb.suffix == ".ekb" and ekb.is_file()
    with zipfile.ZipFile(ekb) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        assert MANIFEST_NAME in zf.namelist()
    bundle = load_bundle(ekb)
    assert bundle.source == ekb
    assert str(bundle.root).startswith(str(tmp_path / "cache"))
    assert bundle.root.name == sha256_file(ekb)[:32]
    assert bundle.component("decoder").read_bytes() == FILES["decoder"][1]
    # a second load reuses the cache
    assert load_bundle(ekb).root == bundle.root


def test_corrupt_archive_names_archive_and_member(tmp_path, sources):
    ekb = _write(tmp_path, sources, archive=True)
    data = bytearray(ekb.read_bytes())
    start = data.find(b"decoder\x08\x07decoder")
    assert start > 0
    data[start + 5] ^= 0x01  # stored, so the member's bytes are in the archive as is
    ekb.write_bytes(bytes(data))
    with pytest.raises(BundleError) as info:
        load_bundle(ekb)
    msg = str(info.value)
    assert str(ekb) in msg and ("checksum mismatch" in msg or "corrupt archive" in msg)
    assert "decoder" in msg


def test_cache_copy_that_went_bad_is_rebuilt(tmp_path, sources):
    ekb = _write(tmp_path, sources, archive=True)
    root = load_bundle(ekb).root
    (root / "config.json").write_text("tampered")
    with pytest.raises(BundleError, match="config.json"):
        load_bundle(ekb)
    assert load_bundle(ekb).component("model_config").read_bytes() == FILES["model_config"][1]


def test_pack_and_unpack(tmp_path, sources):
    out = _write(tmp_path, sources)
    ekb = pack_bundle(out, tmp_path / "packed.ekb")
    back = unpack_bundle(ekb, tmp_path / "unpacked")
    for _role, (name, data) in FILES.items():
        assert (back / name).read_bytes() == data
    assert load_bundle(back).manifest.to_dict() == load_bundle(out).manifest.to_dict()


def test_pack_refuses_corrupt_bundle(tmp_path, sources):
    out = _write(tmp_path, sources)
    (out / "config.json").write_text("x")
    with pytest.raises(BundleError):
        pack_bundle(out, tmp_path / "p.ekb")
    assert not (tmp_path / "p.ekb").exists()


def test_interrupted_write_leaves_nothing_that_looks_complete(tmp_path, sources, monkeypatch):
    calls = {"n": 0}
    real = shutil.copyfile

    def dying_copy(src, dst, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt  # as if the user hit Ctrl-C mid-write
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(bundle_io.shutil, "copyfile", dying_copy)
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, sources)
    assert not (tmp_path / "bundle").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle")]


def test_killed_write_leftover_is_not_a_bundle(tmp_path, sources, monkeypatch):
    # A process killed before the rename leaves only a hidden temp dir without a manifest.
    monkeypatch.setattr(bundle_io, "_write_text_synced", lambda *a: (_ for _ in ()).throw(SystemExit(9)))
    monkeypatch.setattr(bundle_io.shutil, "rmtree", lambda *a, **k: None)  # no cleanup, as after SIGKILL
    with pytest.raises(SystemExit):
        _write(tmp_path, sources)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".bundle")]
    assert leftovers and not (leftovers[0] / MANIFEST_NAME).exists()
    assert not (tmp_path / "bundle").exists()


def test_rewrite_replaces_old_bundle_atomically(tmp_path, sources):
    out = _write(tmp_path, sources)
    sources["model_config"].write_bytes(b'{"hidden": 64}')
    out2 = _write(tmp_path, sources)
    assert out2 == out
    assert load_bundle(out).component("model_config").read_bytes() == b'{"hidden": 64}'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle")]


def test_refuses_to_replace_a_non_bundle_directory(tmp_path, sources):
    precious = tmp_path / "bundle"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(BundleError, match="not a bundle"):
        _write(tmp_path, sources)
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_figures_need_a_source_note(tmp_path, sources):
    with pytest.raises(BundleError, match="source"):
        write_bundle(tmp_path / "b", sources, name="n", target="cpu", provenance={}, figures={"bleu": 0.3})


def test_duplicate_file_names_are_rejected(tmp_path, sources):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    sources["extra"] = other / "config.json"
    with pytest.raises(BundleError, match="already taken"):
        _write(tmp_path, sources)
