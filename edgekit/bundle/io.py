"""Write and load bundles: a directory (or one stored `.ekb` zip) of model files plus a checked manifest.

Writes are atomic (a temp directory renamed into place, manifest last) so a crash never leaves something that
looks like a complete bundle; loads verify every byte so a corrupt download fails here, not mid-inference.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from edgekit import names
from edgekit.bundle.manifest import (
    MANIFEST_NAME,
    Component,
    Manifest,
    read_manifest,
)
from edgekit.bundle.manifest import required_roles as roles_for
from edgekit.errors import BundleError

ARCHIVE_SUFFIX = ".ekb"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def tool_versions() -> dict[str, str]:
    """Versions of what produced a bundle, for provenance (absent packages are left out)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("edgekit", "onnx", "onnxruntime", "numpy", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


@dataclass
class Bundle:
    """A loaded, verified bundle. `root` is its directory (for an archive, the extracted cache copy)."""

    manifest: Manifest
    root: Path
    source: Path  # what the user named: the directory or the .ekb file

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def target(self) -> str:
        return self.manifest.target

    @property
    def roles(self) -> list[str]:
        return sorted(self.manifest.components)

    @property
    def is_text(self) -> bool:
        """A text model's bundle (a decoder alone): no vision graph, so it reads prompts, never studies."""
        return names.VISION not in self.manifest.components

    @property
    def graph_roles(self) -> tuple[str, ...]:
        """The graphs it holds, in `names.GRAPH_ROLES` order: three for a VLM, two for a text model."""
        return tuple(r for r in names.GRAPH_ROLES if r in self.manifest.components)

    @property
    def digest(self) -> str:
        """The bundle's identity: sha256 of its manifest, which lists every file's sha256. The same for a directory
        and its `.ekb`, so a Pareto profile measured on one matches the other."""
        return sha256_file(self.root / MANIFEST_NAME)

    def component(self, role: str) -> Path:
        try:
            entry = self.manifest.components[role]
        except KeyError:
            raise BundleError(f"bundle has no {role!r} component", self.source) from None
        return self.root / entry.path


# --- writing --------------------------------------------------------------------------------------------------


def _check_figures(figures: dict[str, Any]) -> None:
    for key, value in figures.items():
        if not isinstance(value, dict) or not isinstance(value.get("source"), str):
            raise BundleError(f"figure {key!r} must be an object with a 'source' note saying how it was measured")


def write_bundle(
    out: str | os.PathLike,
    components: dict[str, str | os.PathLike],
    *,
    name: str,
    target: str,
    provenance: dict[str, Any] | None = None,
    figures: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    archive: bool = False,
    required_roles: tuple[str, ...] | None = None,
    link: bool = False,
) -> Path:
    """Copy `components` ({role: file}) into a new bundle at `out`; returns the directory or `.ekb` path.

    `required_roles`: the roles it must hold (default: a VLM's with a vision graph, else a text model's,
    `manifest.required_roles`). An existing bundle at `out` is replaced only once the new one is complete.
    `link`: hard-link the components where the file system allows, else copy: for a bundle nobody will modify
    or ship (the build's staging copy, which its evaluation and reference outputs read), so a build writes the
    model's bytes once, not twice.
    """
    out = Path(out)
    if archive and out.suffix != ARCHIVE_SUFFIX:
        out = out.with_name(out.name + ARCHIVE_SUFFIX)
    missing = [r for r in (roles_for(components) if required_roles is None else required_roles) if r not in components]
    if missing:
        raise BundleError(f"missing required component(s): {', '.join(missing)}", out)
    figures = dict(figures or {})
    _check_figures(figures)
    names: dict[str, str] = {}
    for role, src in components.items():
        src = Path(src)
        if not src.is_file():
            raise BundleError(f"component {role!r}: no such file", src)
        if src.name == MANIFEST_NAME or src.name in names:
            raise BundleError(f"component {role!r}: file name {src.name!r} is already taken in the bundle", src)
        names[src.name] = role

    if not archive and out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise BundleError("exists and is not a bundle; refusing to replace it", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        entries: dict[str, Component] = {}
        for role, src in components.items():
            dst = tmp / Path(src).name
            _place(Path(src), dst, link=link)
            entries[role] = Component(dst.name, sha256_file(dst), dst.stat().st_size)
        prov = dict(provenance or {})
        prov.setdefault("passes", [])
        prov["tools"] = {**tool_versions(), **prov.get("tools", {})}
        figures.setdefault(  # the one size figure (a build states the same sum before copying)
            "size", {"bytes": sum(c.bytes for c in entries.values()), "source": "sum of the bundle's component files"}
        )
        manifest = Manifest(
            name=name,
            target=target,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            components=entries,
            provenance=prov,
            figures=figures,
            runtime=dict(runtime or {}),
        )
        _write_text_synced(tmp / MANIFEST_NAME, manifest.to_json())  # last: its presence means "complete"
        if archive:
            zip_dir(tmp, out)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _place(src: Path, dst: Path, *, link: bool) -> None:
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links refused (fs.protected_hardlinks): a copy
            pass
    shutil.copyfile(src, dst)


def _write_text_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: Path, text: str) -> None:
    """Write text to `path` whole or not at all (`replace_bytes`): a signature, a rollout's state."""
    replace_bytes(path, text.encode("utf-8"))


def replace_bytes(path: Path, chunks: bytes | bytearray | memoryview | Iterable[bytes | memoryview]) -> int:
    """Write `chunks` (one buffer or an iterable of them) to `path` whole or not at all, and return the bytes
    written: a temporary file beside it, fsynced, renamed over it, the directory fsynced (what a crash or power cut
    may interrupt: a signature, a rollout's state, an Orin engine and its cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    written = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in [chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks:
                f.write(chunk)
                written += memoryview(chunk).nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return written


def replace_dir(new: Path, out: Path) -> None:
    """Move `new` to `out`; an existing `out` is moved aside first and deleted only after the swap."""
    if out.exists() and not out.is_dir():
        raise BundleError("exists and is not a directory", out)
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise BundleError("exists and is not a bundle; refusing to replace it", out)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def zip_dir(root: Path, out: Path) -> None:
    """Stored (uncompressed) zip written to a temp file then renamed: ONNX weights do not compress anyway,
    and stored members can be checked and extracted fast."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp_name, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            files = sorted(p for p in root.rglob("*") if p.is_file())
            for p in files:
                if p.name != MANIFEST_NAME:
                    zf.write(p, p.relative_to(root).as_posix())
            zf.write(root / MANIFEST_NAME, MANIFEST_NAME)
        with open(tmp_name, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


# --- loading --------------------------------------------------------------------------------------------------


def verify_dir(root: Path, *, required_roles: tuple[str, ...] | None = None) -> Manifest:
    """Check the manifest and every component file under `root`; raise BundleError naming the bad file.
    `required_roles`: the roles it must hold (default: by its graphs, `manifest.required_roles`)."""
    manifest = read_manifest(root)
    required = roles_for(manifest.components) if required_roles is None else required_roles
    missing = [r for r in required if r not in manifest.components]
    if missing:
        raise BundleError(f"manifest lacks required component(s): {', '.join(missing)}", root / MANIFEST_NAME)
    for role, entry in sorted(manifest.components.items()):
        path = root / entry.path
        if not path.is_file():
            raise BundleError(f"missing component file ({role})", path)
        size = path.stat().st_size
        if size < entry.bytes:
            raise BundleError(f"truncated: {size} of {entry.bytes} bytes ({role})", path)
        if size > entry.bytes:
            raise BundleError(f"size mismatch: {size} bytes, manifest says {entry.bytes} ({role})", path)
        if sha256_file(path) != entry.sha256:
            raise BundleError(f"checksum mismatch: sha256 differs from the manifest ({role})", path)
    return manifest


def cache_dir() -> Path:
    base = os.environ.get("EDGEKIT_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "edgekit"


def _extract_archive(path: Path) -> Path:
    """Extract an `.ekb` once into a cache directory keyed by the archive's sha256, atomically."""
    digest = sha256_file(path)
    final = cache_dir() / "bundles" / digest[:32]
    if (final / MANIFEST_NAME).is_file():
        return final
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise BundleError("not a valid .ekb archive (bad zip)", path) from None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        with zf:
            for info in zf.infolist():
                parts = PurePosixPath(info.filename).parts
                if (
                    info.filename.startswith(("/", "\\"))
                    or ".." in parts
                    or "\\" in info.filename
                    or (parts and ":" in parts[0])
                ):
                    raise BundleError(f"archive entry {info.filename!r} escapes the bundle", path)
            try:
                zf.extractall(tmp)
            except (zipfile.BadZipFile, OSError, EOFError) as err:
                raise BundleError(f"corrupt archive: {type(err).__name__}: {err}", path) from None
        if not (tmp / MANIFEST_NAME).is_file():
            raise BundleError(f"archive holds no {MANIFEST_NAME}", path)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / MANIFEST_NAME).is_file():  # not a concurrent extract winning the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def peek_manifest(path: str | os.PathLike) -> Manifest:
    """A bundle's manifest (directory or `.ekb`) read without checking its files or extracting an archive: what a
    caller needs to route a request before the bundle is loaded (a text model's bundle or a VLM's), cheaply.
    `load_bundle` still verifies everything before anything runs."""
    path = Path(path)
    if path.is_dir():
        return read_manifest(path)
    try:
        with zipfile.ZipFile(path) as zf:
            data = zf.read(MANIFEST_NAME)
    except (OSError, zipfile.BadZipFile, KeyError):
        raise BundleError("not a bundle: no readable manifest (directory or .ekb file)", path) from None
    try:
        return Manifest.from_dict(json.loads(data), path)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BundleError("manifest is not valid JSON", path) from None


def load_bundle(path: str | os.PathLike, *, required_roles: tuple[str, ...] | None = None) -> Bundle:
    """Open a bundle directory or `.ekb` archive and verify it completely (`required_roles`: as `verify_dir`)."""
    path = Path(path)
    if not path.exists():
        raise BundleError("no such bundle (directory or .ekb file)", path)
    if path.is_dir():
        root = path
    elif zipfile.is_zipfile(path):
        root = _extract_archive(path)
    else:
        raise BundleError("not a bundle: neither a directory nor an .ekb (zip) archive", path)
    try:
        manifest = verify_dir(root, required_roles=required_roles)
    except BundleError as err:
        if root is not path:  # name the archive, not our cache, and drop a cache copy that went bad
            shutil.rmtree(root, ignore_errors=True)
            inner = (
                Path(err.path).relative_to(root).as_posix()
                if err.path and Path(err.path).is_relative_to(root)
                else None
            )
            raise BundleError(f"{inner}: {err.reason}" if inner else err.reason, path) from None
        raise
    return Bundle(manifest=manifest, root=root, source=path)
