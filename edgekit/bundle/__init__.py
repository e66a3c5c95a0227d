"""Deployable bundles: model files plus a manifest of checksums, provenance and measured figures."""

from edgekit.bundle.archive import pack_bundle, unpack_bundle
from edgekit.bundle.io import Bundle, cache_dir, load_bundle, peek_manifest, sha256_file, verify_dir, write_bundle
from edgekit.bundle.manifest import (
    MANIFEST_NAME,
    REQUIRED_ROLES,
    ROLES,
    SCHEMA_VERSION,
    TEXT_ROLES,
    Component,
    Manifest,
)

__all__ = [
    "MANIFEST_NAME",
    "REQUIRED_ROLES",
    "ROLES",
    "SCHEMA_VERSION",
    "TEXT_ROLES",
    "Bundle",
    "Component",
    "Manifest",
    "cache_dir",
    "load_bundle",
    "peek_manifest",
    "pack_bundle",
    "sha256_file",
    "unpack_bundle",
    "verify_dir",
    "write_bundle",
]
