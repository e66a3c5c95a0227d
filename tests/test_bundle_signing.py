"""Signed bundles (edgekit.bundle.signing, minisign's format): edgekit's signatures verify with Debian's `minisign`
and minisign's with edgekit; a tampered, truncated, unsigned or foreign-signed bundle is refused with its code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile

import pytest

from edgekit.bundle import load_bundle, pack_bundle
from edgekit.bundle.minisign import PublicKey, SecretKey, SignatureError
from edgekit.bundle.signing import SIGNATURE_NAME, read_public_keys, sign_bundle, verify_signature
from edgekit.errors import BundleError

MINISIGN = shutil.which("minisign")
needs_minisign = pytest.mark.skipif(
    MINISIGN is None, reason="Debian's minisign is not installed (apt-get install minisign)"
)


@pytest.fixture
def key():
    return SecretKey.generate()


def test_a_signed_bundle_verifies_and_its_comment_names_it(placeholder_bundle, key):
    signed = sign_bundle(placeholder_bundle, key)
    assert (placeholder_bundle / SIGNATURE_NAME).is_file()
    got = verify_signature(placeholder_bundle, [key.public()])
    assert got == signed and got.key_id == key.public().id_hex
    assert got.comment["name"] == "tiny" and got.comment["target"] == "cpu"
    assert got.comment["manifest_sha256"] == load_bundle(placeholder_bundle).digest
    load_bundle(placeholder_bundle)  # the signature is a file beside the manifest, not a component


def test_refusals_each_with_its_code(placeholder_bundle, key, tmp_path):
    with pytest.raises(SignatureError, match="not signed") as err:
        verify_signature(placeholder_bundle, [key.public()])
    assert err.value.code == "unsigned_bundle"
    sign_bundle(placeholder_bundle, key)
    other, next_key = SecretKey.generate(), SecretKey.generate()
    with pytest.raises(SignatureError, match="not trusted") as err:
        verify_signature(placeholder_bundle, [other.public()])
    assert err.value.code == "untrusted_key" and err.value.http_status == 422
    # key rotation: the signing key among several trusted ones
    assert verify_signature(placeholder_bundle, [other.public(), key.public(), next_key.public()]).key_id
    # a component changed: the manifest (and so the signature) still verify, the files do not
    comp = next(p for p in placeholder_bundle.iterdir() if p.suffix == ".bin")
    original = comp.read_bytes()
    comp.write_bytes(original[:-1] + b"X")
    verify_signature(placeholder_bundle, [key.public()])
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(placeholder_bundle)
    comp.write_bytes(original[:10])
    with pytest.raises(BundleError, match="truncated"):
        load_bundle(placeholder_bundle)
    comp.write_bytes(original)
    # the manifest changed: the signature does not verify
    manifest = placeholder_bundle / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"tiny"', '"tinx"'))
    with pytest.raises(SignatureError, match="does not verify") as err:
        verify_signature(placeholder_bundle, [key.public()])
    assert err.value.code == "bad_signature"
    (placeholder_bundle / SIGNATURE_NAME).write_text("untrusted comment: x\nnot base64!\n")
    with pytest.raises(SignatureError, match="not a minisign signature"):
        verify_signature(placeholder_bundle, [key.public()])


def test_an_archive_is_signed_inside_and_verified_without_extracting(placeholder_bundle, key):
    ekb = pack_bundle(placeholder_bundle)
    sign_bundle(ekb, key)
    with zipfile.ZipFile(ekb) as zf:
        assert SIGNATURE_NAME in zf.namelist()
    assert verify_signature(ekb, [key.public()]).comment["name"] == "tiny"
    assert (load_bundle(ekb).root / SIGNATURE_NAME).is_file()


def test_trusted_keys_from_files_and_base64_lines(tmp_path, key):
    pub = key.public()
    (tmp_path / "a.pub").write_text(pub.to_text())
    assert read_public_keys(["a.pub", pub.to_base64()], base=tmp_path) == [pub, pub]
    (tmp_path / "bad.pub").write_text("untrusted comment: x\nRWQAAA==\n")
    with pytest.raises(SignatureError, match="42 bytes"):
        read_public_keys(["bad.pub"], base=tmp_path)
    with pytest.raises(SignatureError, match="no such file"):
        read_public_keys(["missing.pub"], base=tmp_path)


@needs_minisign
def test_debian_minisign_verifies_edgekit_and_edgekit_verifies_minisign(placeholder_bundle, tmp_path, key):
    pub = tmp_path / "edgekit.pub"
    pub.write_text(key.public().to_text())
    sign_bundle(placeholder_bundle, key)
    manifest = placeholder_bundle / "manifest.json"
    out = subprocess.run(
        [MINISIGN, "-V", "-p", pub, "-m", manifest, "-x", placeholder_bundle / SIGNATURE_NAME],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "edgekit-bundle name=tiny target=cpu" in out.stdout
    # minisign's own key (unencrypted, -W) signs with edgekit, and minisign signs with its own comment
    subprocess.run([MINISIGN, "-G", "-W", "-p", tmp_path / "m.pub", "-s", tmp_path / "m.key"], check=True)
    theirs = PublicKey.read(tmp_path / "m.pub")
    sign_bundle(placeholder_bundle, SecretKey.read(tmp_path / "m.key"))
    assert verify_signature(placeholder_bundle, [theirs]).key_id == theirs.id_hex
    (placeholder_bundle / SIGNATURE_NAME).unlink()
    subprocess.run([MINISIGN, "-S", "-s", tmp_path / "m.key", "-m", manifest, "-t", "release 7"], check=True)
    assert verify_signature(placeholder_bundle, [theirs]).comment == {"comment": "release 7"}
    # an edgekit key file works in minisign
    (tmp_path / "e.key").write_text(key.to_text())
    (placeholder_bundle / SIGNATURE_NAME).unlink()
    subprocess.run([MINISIGN, "-S", "-s", tmp_path / "e.key", "-m", manifest], check=True)
    assert verify_signature(placeholder_bundle, [key.public()]).key_id == key.public().id_hex


@needs_minisign
def test_a_password_protected_minisign_key(tmp_path):
    """minisign's default keys are encrypted with scrypt (libsodium's parameters: 1 GiB, a few seconds)."""
    subprocess.run(
        [MINISIGN, "-G", "-p", tmp_path / "e.pub", "-s", tmp_path / "e.key"],
        input="s3cret\ns3cret\n",
        text=True,
        check=True,
        capture_output=True,
    )
    assert SecretKey.read(tmp_path / "e.key", "s3cret").public() == PublicKey.read(tmp_path / "e.pub")
    with pytest.raises(SignatureError, match="wrong password"):
        SecretKey.read(tmp_path / "e.key", "guess")
    with pytest.raises(SignatureError, match="encrypted"):
        SecretKey.read(tmp_path / "e.key")


@pytest.mark.skipif(os.environ.get("EDGEKIT_REQUIRE_PACS") != "1", reason="EDGEKIT_REQUIRE_PACS=1 not set")
def test_ci_has_debian_minisign():
    """CI installs Debian's parts where it can (EDGEKIT_REQUIRE_PACS=1): the interop tests must not hide as skips."""
    assert MINISIGN is not None


def test_the_cli_signs_verifies_and_refuses_in_one_line(placeholder_bundle, tmp_path, capsys):
    from edgekit.cli.app import main

    assert main(["bundle", "keygen", "-o", str(tmp_path / "rel")]) == 0
    assert oct((tmp_path / "rel.key").stat().st_mode & 0o777) == "0o600"
    assert main(["bundle", "sign", str(placeholder_bundle), "--key", str(tmp_path / "rel.key")]) == 0
    capsys.readouterr()
    assert main(["bundle", "verify", str(placeholder_bundle), "--pubkey", str(tmp_path / "rel.pub"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["signature"]["name"] == "tiny"
    assert main(["bundle", "keygen", "-o", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    assert main(["bundle", "verify", str(placeholder_bundle), "--pubkey", str(tmp_path / "other.pub")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "which is not trusted" in err[0] and "Traceback" not in err[0]
    assert main(["bundle", "verify", str(placeholder_bundle), "--pubkey", str(tmp_path / "other.pub"), "--json"]) != 0
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "untrusted_key"
