"""Signed bundles: a minisign signature of the manifest, which lists every file's sha256, so one signature covers
the whole bundle.

Why the manifest and not each file: the manifest already binds every file by sha256 and size (`verify_dir`), so
signing it signs them all, and a signature check costs one small file however large the weights are; `load_bundle`
still checks every file against it. The signature lives beside the manifest as `manifest.json.minisig` (inside the
`.ekb` for an archive), in minisign's format, so `minisign -Vm manifest.json -p KEY.pub` checks it too. Its trusted
comment (signed) names the bundle, its target, when it was built, the edgekit that built it and the manifest's
sha256, so a verified signature also says which bundle it was made for. A signature made by `minisign -Sm
manifest.json` with a comment of its own verifies too (the Ed25519 signature covers the manifest's bytes either
way); its comment is reported as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from edgekit.bundle.io import load_bundle, replace_file, zip_dir
from edgekit.bundle.manifest import MANIFEST_NAME, Manifest
from edgekit.bundle.minisign import PublicKey, SecretKey, Signature, SignatureError, sign, verify
from edgekit.errors import BundleError

SIGNATURE_NAME = MANIFEST_NAME + ".minisig"
COMMENT_PREFIX = "edgekit-bundle"


@dataclass(frozen=True)
class SignedBy:
    """A signature that verified: the key that made it and what its trusted comment says."""

    key_id: str
    comment: dict[str, str]

    def to_dict(self) -> dict:
        return {"key_id": self.key_id, **self.comment}


def trusted_comment(manifest: Manifest, digest: str) -> str:
    built_by = manifest.provenance.get("tools", {}).get("edgekit", "unknown")
    fields = {
        "name": manifest.name,
        "target": manifest.target,
        "created": manifest.created,
        "edgekit": built_by,
        "manifest_sha256": digest,
    }
    return " ".join([COMMENT_PREFIX, *(f"{k}={str(v).replace(' ', '_')}" for k, v in fields.items())])


def parse_comment(comment: str) -> dict[str, str]:
    words = comment.split()
    if not words or words[0] != COMMENT_PREFIX:
        return {}
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


def _read_signed(path: Path) -> tuple[bytes, str | None]:
    """(manifest bytes, signature text or None) of a bundle directory or `.ekb`, without extracting it."""
    if path.is_dir():
        sig = path / SIGNATURE_NAME
        try:
            return (path / MANIFEST_NAME).read_bytes(), sig.read_text() if sig.is_file() else None
        except FileNotFoundError:
            raise BundleError(f"not a bundle: no {MANIFEST_NAME}", path) from None
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            manifest = zf.read(MANIFEST_NAME)
            return manifest, zf.read(SIGNATURE_NAME).decode() if SIGNATURE_NAME in names else None
    except FileNotFoundError:
        raise BundleError("no such bundle (directory or .ekb file)", path) from None
    except (OSError, zipfile.BadZipFile, KeyError, UnicodeDecodeError):
        raise BundleError("not a bundle: no readable manifest (directory or .ekb file)", path) from None


def manifest_digest(path: str | os.PathLike) -> str:
    """sha256 of a bundle's manifest as it is on disk now (a directory's, or inside an `.ekb`): `Bundle.digest`
    without loading the bundle."""
    return hashlib.sha256(_read_signed(Path(path))[0]).hexdigest()


def verify_signature(path: str | os.PathLike, keys: list[PublicKey]) -> SignedBy:
    """Check that a bundle is signed by one of `keys` and that the signature was made for this manifest.
    The files are checked against the manifest by `load_bundle`; a caller that serves the bundle does both."""
    path = Path(path)
    manifest_bytes, text = _read_signed(path)
    if text is None:
        raise SignatureError(f"the bundle is not signed (no {SIGNATURE_NAME})", path, code="unsigned_bundle")
    signature = Signature.parse(text, path)
    key = verify(manifest_bytes, signature, keys, path)
    comment = parse_comment(signature.trusted_comment)  # {} for a comment not in edgekit's form (`minisign -S`)
    if comment and comment.get("manifest_sha256") != hashlib.sha256(manifest_bytes).hexdigest():
        raise SignatureError("the signature's trusted comment names another manifest", path)
    return SignedBy(key.id_hex, comment or {"comment": signature.trusted_comment})


def sign_bundle(path: str | os.PathLike, key: SecretKey) -> SignedBy:
    """Verify the bundle (every file against its manifest), then sign its manifest: beside it in a directory, or
    inside the archive (rewritten whole, then renamed over the old one) for an `.ekb`."""
    path = Path(path)
    bundle = load_bundle(path, required_roles=())
    manifest_bytes = (bundle.root / MANIFEST_NAME).read_bytes()
    comment = trusted_comment(bundle.manifest, hashlib.sha256(manifest_bytes).hexdigest())
    text = sign(manifest_bytes, key, comment).to_text()
    if path.is_dir():
        replace_file(path / SIGNATURE_NAME, text)
    else:
        _rewrite_archive(bundle.root, path, text)
    return SignedBy(key.public().id_hex, parse_comment(comment))


def _rewrite_archive(root: Path, archive: Path, signature: str) -> None:
    """The extracted bundle (hard links where the file system allows) plus the signature, zipped over `archive`."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{archive.name}.sign-", dir=archive.parent))
    try:
        staged = tmp / "bundle"

        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

        shutil.copytree(root, staged, copy_function=link)
        (staged / SIGNATURE_NAME).write_text(signature)
        zip_dir(staged, archive)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_public_keys(entries: list[str] | tuple[str, ...], base: Path | None = None) -> list[PublicKey]:
    """Trusted keys from a config: each a `.pub` file (relative to `base`) or a key's base64 line (`RWQ...`)."""
    keys = []
    for entry in entries:
        candidate = Path(entry) if base is None or Path(entry).is_absolute() else base / entry
        if entry.startswith("RW") and not candidate.exists():
            keys.append(PublicKey.from_base64(entry))
        else:
            keys.append(PublicKey.read(candidate))
    return keys
