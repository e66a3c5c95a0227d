"""`manifest.json`: what a bundle holds, how to check it, and where it came from.

A plain dataclass with its own (de)serialisation so that every field a reader relies on is validated in one
place, and a bundle from a newer edgekit fails with a clear message instead of a KeyError deep in a runtime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from edgekit import names
from edgekit.errors import BundleError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

ROLES = (*names.GRAPH_ROLES, *names.WEIGHT_FILES)  # a VLM's bundle: the three graphs and the model's files
REQUIRED_ROLES = ROLES
# what reads images: a bundle with a vision graph needs its preprocessing; a bundle without one is a text model's
VISION_ROLES = (names.VISION, "preprocessor_config")
TEXT_ROLES = tuple(r for r in ROLES if r not in VISION_ROLES)  # a text model's bundle (a decoder alone)
# a graph whose weights are external (past protobuf's 2 GB: a 2B-class import) ships `<graph>.onnx.data` beside
# it under this optional role; the runtimes find it by the graph's own reference to the file name
EXTERNAL_DATA_ROLES = {role: f"{role}_data" for role in names.GRAPH_ROLES}


def required_roles(components) -> tuple[str, ...]:
    """The roles a bundle holding `components` (role names) must have: every role of a VLM's bundle when it has a
    vision graph, else a text model's. A bundle says what it is by its graphs, so no second field can disagree."""
    return REQUIRED_ROLES if names.VISION in components else TEXT_ROLES


@dataclass(frozen=True)
class Component:
    """One file of the bundle: its path relative to the bundle root, sha256 hex digest and size."""

    path: str
    sha256: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "bytes": self.bytes}


@dataclass
class Manifest:
    name: str
    target: str
    created: str  # ISO 8601, UTC
    components: dict[str, Component]
    provenance: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    runtime: dict[str, Any] = field(default_factory=dict)  # the target's run-side settings (x1: DSS)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "target": self.target,
            "created": self.created,
            "components": {role: c.to_dict() for role, c in sorted(self.components.items())},
            "provenance": self.provenance,
            "figures": self.figures,
            "runtime": self.runtime,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str | Path) -> Manifest:
        """Validate and build; `where` (the manifest's path) is named in every error."""
        if not isinstance(data, dict):
            raise BundleError("manifest is not a JSON object", where)
        version = data.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise BundleError(f"manifest has no valid schema_version (got {version!r})", where)
        if version > SCHEMA_VERSION:
            raise BundleError(
                f"written by a newer edgekit (bundle schema {version}, this edgekit reads up to {SCHEMA_VERSION});"
                " upgrade edgekit",
                where,
            )
        for key, kind in (("name", str), ("target", str), ("created", str), ("components", dict)):
            if not isinstance(data.get(key), kind):
                raise BundleError(f"manifest field {key!r} is missing or not a {kind.__name__}", where)
        components: dict[str, Component] = {}
        for role, entry in data["components"].items():
            if not isinstance(entry, dict):
                raise BundleError(f"component {role!r} is not an object", where)
            path, digest, size = entry.get("path"), entry.get("sha256"), entry.get("bytes")
            if not isinstance(path, str) or not _is_safe_relative(path):
                raise BundleError(f"component {role!r} has an invalid path {path!r}", where)
            if not isinstance(digest, str) or len(digest) != 64:
                raise BundleError(f"component {role!r} has an invalid sha256", where)
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise BundleError(f"component {role!r} has an invalid size", where)
            components[role] = Component(path, digest.lower(), size)
        for key in ("provenance", "figures", "runtime"):
            if not isinstance(data.get(key, {}), dict):
                raise BundleError(f"manifest field {key!r} is not an object", where)
        return cls(
            name=data["name"],
            target=data["target"],
            created=data["created"],
            components=components,
            provenance=data.get("provenance", {}),
            figures=data.get("figures", {}),
            runtime=data.get("runtime", {}),
            schema_version=version,
        )


def _is_safe_relative(path: str) -> bool:
    """A component path must stay inside the bundle: relative, no '..', no drive letters or backslashes."""
    if not path or "\\" in path or ":" in path or path.startswith("/"):
        return False
    parts = PurePosixPath(path).parts
    return all(p not in ("..", ".", "") for p in parts) and parts != ()


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(f"no {MANIFEST_NAME}: not a bundle, or an interrupted write", root)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise BundleError(f"manifest is not valid JSON (line {err.lineno}: {err.msg})", path) from None
    except (OSError, UnicodeDecodeError) as err:
        raise BundleError(f"cannot read manifest: {type(err).__name__}", path) from None
    return Manifest.from_dict(data, path)
