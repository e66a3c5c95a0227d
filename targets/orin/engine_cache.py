"""Engines on disk: `<state>/engines/<bundle id>/<device key>/` holds one `.plan` per graph and `engines.json`
(the facts they were built for, their checksums, build time and peak host memory); the timing cache sits beside
the engine folders, one per TensorRT version and SM.

The bundle id hashes the graphs and the plan, the device key the TensorRT version, L4T release, SM and device
(`device.DeviceFacts.key`): change any of them and the lookup misses, so the engines are rebuilt. An engine
folder whose recorded facts are not this device's (copied from another Jetson or JetPack) is refused in one line
naming its `engines.json` and what differs. Writes are atomic: a temp file in the same folder, fsync, rename,
`engines.json` last, so an interrupted build never leaves something that looks complete.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from edgekit import names
from edgekit.bundle import sha256_file
from edgekit.bundle.io import replace_bytes
from edgekit.errors import ConfigError

from .device import DeviceFacts

META = "engines.json"
ENGINE_FILES = {role: f"{Path(f).stem}.plan" for role, f in names.GRAPH_FILES.items()}


class EngineMismatchError(ConfigError):
    code = "engine_mismatch"


def bundle_id(bundle, plan: dict) -> str:
    """The graphs' checksums and the plan, hashed: what an engine was built from."""
    h = hashlib.sha256()
    for role in bundle.graph_roles:
        h.update(bundle.manifest.components[role].sha256.encode())
    h.update(json.dumps(plan, sort_keys=True, default=str).encode())
    return f"{bundle.name}-{h.hexdigest()[:16]}"


@dataclass(frozen=True)
class EngineCache:
    """The engine folder of one bundle on one device."""

    root: Path  # the state directory
    bundle: str  # bundle_id
    facts: DeviceFacts

    @property
    def folder(self) -> Path:
        return self.root / "engines" / self.bundle / self.facts.key()

    @property
    def meta_path(self) -> Path:
        return self.folder / META

    @property
    def timing_cache(self) -> Path:
        return self.root / "engines" / f"timing-trt{self.facts.tensorrt}-sm{self.facts.sm or 'none'}.cache"

    def engine(self, role: str) -> Path:
        return self.folder / ENGINE_FILES[role]

    def others(self) -> list[str]:
        """Device keys this bundle has engines for, other than this device's."""
        parent = self.root / "engines" / self.bundle
        if not parent.is_dir():
            return []
        return sorted(p.name for p in parent.iterdir() if p.is_dir() and p.name != self.facts.key())

    def read_meta(self) -> dict | None:
        try:
            return json.loads(self.meta_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as err:
            raise EngineMismatchError(f"unreadable engine record ({type(err).__name__})", self.meta_path) from None

    def write_meta(self, meta: dict) -> Path:
        replace_bytes(self.meta_path, (json.dumps(meta, indent=1) + "\n").encode())
        return self.meta_path

    def is_complete(self) -> bool:
        """Every engine present with the checksum its record names, for this device's facts."""
        meta = self.read_meta()
        if meta is None:
            return False
        check_folder(self.folder, self.facts, self.bundle)
        return bool(meta.get("engines")) and all(self.engine(r).is_file() for r in meta["engines"])

    def require(self) -> dict:
        """The record of a complete engine folder for this device, or a one-line refusal saying what to run."""
        meta = self.read_meta()
        if meta is None:
            other = self.others()
            seen = f"; engines exist for other devices or JetPacks ({', '.join(other)})" if other else ""
            raise EngineMismatchError(
                f"no TensorRT engines for this bundle on this device{seen}: run `edgekit engine build BUNDLE`",
                self.folder,
            )
        return check_folder(self.folder, self.facts, self.bundle)


def check_folder(folder: Path, facts: DeviceFacts, bundle: str | None = None) -> dict:
    """The engine record of `folder` if it was built for `facts` (and `bundle`) and its files are intact; else a
    one-line refusal naming the file and what differs. Reads files only: no GPU work."""
    path = folder / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineMismatchError("no engine record (not an engine folder, or an interrupted build)", path) from None
    except (OSError, json.JSONDecodeError) as err:
        raise EngineMismatchError(f"unreadable engine record ({type(err).__name__})", path) from None
    built = DeviceFacts(**{k: meta.get("facts", {}).get(k) for k in ("tensorrt", "l4t", "sm", "device")})
    diff = built.differences(facts)
    if diff:
        raise EngineMismatchError(
            f"engines built for {', '.join(diff)}; a TensorRT engine runs only where it was built: "
            "rebuild with `edgekit engine build BUNDLE`",
            path,
        )
    if bundle is not None and meta.get("bundle") != bundle:
        raise EngineMismatchError(
            f"engines built from another bundle or plan ({meta.get('bundle')}, this one is {bundle}): rebuild", path
        )
    for role, entry in meta.get("engines", {}).items():
        engine = folder / entry["file"]
        if not engine.is_file():
            raise EngineMismatchError(f"engine file missing ({role})", engine)
        if engine.stat().st_size != entry["bytes"] or sha256_file(engine) != entry["sha256"]:
            raise EngineMismatchError(f"engine file does not match its record ({role}): rebuild", engine)
    return meta
