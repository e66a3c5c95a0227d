"""The DICOM networking settings: `[dicom]`, `[dimse]`, `[delivery]` and `[[destinations]]` of edgekitd.toml.

Apart from `config.py` because these sections nest (allowed calling AEs, one table per destination) and are read
only by the networking parts (`dicomweb.py`, `dimse.py`, `studies.py`, `delivery.py`). Every key has a default:
without these sections STOW-RS is served (it needs no setting), the SCP is off and nothing is delivered.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from edgekit.errors import ConfigError

AE_TITLE = re.compile(r"^[\x20-\x5b\x5d-\x7e]{1,16}$")  # 16 chars of the default character repertoire, no backslash
DESTINATION_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
DESTINATION_KINDS = ("stow", "cstore", "webhook")


@dataclass(frozen=True)
class AllowedPeer:
    """A calling AE title the SCP accepts, from one host (an IP address, or "*" for any)."""

    ae_title: str
    host: str = "127.0.0.1"

    def admits(self, ae_title: str, address: str) -> bool:
        return ae_title.strip() == self.ae_title and (self.host == "*" or self.host == address)


@dataclass(frozen=True)
class Destination:
    """Where a finished report goes: its SR by STOW-RS (`url` = the DICOMweb base) or C-STORE (AE at host:port),
    or the job's JSON by a webhook POST (`url`)."""

    name: str
    kind: str
    url: str | None = None
    ae_title: str | None = None
    host: str | None = None
    port: int | None = None
    token_file: Path | None = None  # a bearer token sent to a STOW-RS or webhook URL
    timeout_s: float = 30.0

    def describe(self) -> str:
        """A log- and API-safe name of the target: the URL as scheme://host[:port]/path, without the user:password@
        and the query string a URL can carry credentials in (`last_error` is served by the API and logged)."""
        if self.kind == "cstore":
            return f"{self.name} (C-STORE {self.ae_title}@{self.host}:{self.port})"
        return f"{self.name} ({self.kind} {_safe_url(self.url or '')})"


def _safe_url(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # not a number: left out rather than echoed
        port = ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


@dataclass(frozen=True)
class DicomSettings:
    # [dicom]: what received studies become
    stow: bool = True  # serve POST /dicomweb/studies
    quiet_period_s: float = 10.0  # a study is complete this long after its last instance arrived
    prompt: str = ""  # the prompt every received study is reported with (the clinical question, if any)
    # [dimse]: the Storage SCP
    scp: bool = False
    ae_title: str = "EDGEKIT"
    scp_host: str = "127.0.0.1"
    scp_port: int = 11112
    allowed: tuple[AllowedPeer, ...] = ()
    max_associations: int = 8
    # [delivery]
    max_attempts: int = 6  # a delivery that failed this many times is a dead letter
    backoff_s: float = 2.0  # the first retry waits this long; each later one twice the one before
    max_backoff_s: float = 300.0
    poll_s: float = 0.5  # how often the delivery worker looks for due deliveries when nobody wakes it
    destinations: tuple[Destination, ...] = field(default_factory=tuple)

    def destination(self, name: str) -> Destination | None:
        return next((d for d in self.destinations if d.name == name), None)


_DICOM = {"stow": bool, "quiet_period_s": (int, float), "prompt": str}
_DIMSE = {
    "enabled": bool,
    "ae_title": str,
    "host": str,
    "port": int,
    "allowed": list,
    "max_associations": int,
}
_DELIVERY = {"max_attempts": int, "backoff_s": (int, float), "max_backoff_s": (int, float), "poll_s": (int, float)}
_DEST = {
    "name": str,
    "kind": str,
    "url": str,
    "ae_title": str,
    "host": str,
    "port": int,
    "token_file": str,
    "timeout_s": (int, float),
}
SECTIONS = ("dicom", "dimse", "delivery", "destinations")


def _typed(section: str, table: Any, kinds: dict[str, Any], path: Path) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] must be a table", path)
    unknown = sorted(set(table) - set(kinds))
    if unknown:
        raise ConfigError(f"unknown key {section}.{unknown[0]} (known: {', '.join(sorted(kinds))})", path)
    for key, value in table.items():
        kind = kinds[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"{section}.{key} has the wrong type ({type(value).__name__})", path)
    return table


def read_sections(data: dict[str, Any], path: Path, resolve) -> DicomSettings | None:
    """The DICOM settings from a parsed TOML file (None when it has none of the sections)."""
    if not any(s in data for s in SECTIONS):
        return None
    values: dict[str, Any] = {}
    dicom = _typed("dicom", data.get("dicom", {}), _DICOM, path)
    values.update({k: (float(v) if k == "quiet_period_s" else v) for k, v in dicom.items()})
    dimse = _typed("dimse", data.get("dimse", {}), _DIMSE, path)
    rename = {"enabled": "scp", "host": "scp_host", "port": "scp_port"}
    for key, value in dimse.items():
        if key == "allowed":
            values["allowed"] = _allowed(value, path)
        else:
            values[rename.get(key, key)] = value
    delivery = _typed("delivery", data.get("delivery", {}), _DELIVERY, path)
    values.update({k: (v if k == "max_attempts" else float(v)) for k, v in delivery.items()})
    dests = data.get("destinations", [])
    if not isinstance(dests, list):
        raise ConfigError("destinations must be an array of tables: [[destinations]] name = ..., kind = ...", path)
    values["destinations"] = tuple(_destination(i, d, path, resolve) for i, d in enumerate(dests))
    settings = DicomSettings(**values)
    check(settings, path)
    return settings


def _allowed(items: list, path: Path) -> tuple[AllowedPeer, ...]:
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) - {"ae_title", "host"} or not isinstance(item.get("ae_title"), str):
            raise ConfigError(f'dimse.allowed[{i}] needs ae_title = "..." and optionally host = "..."', path)
        host = item.get("host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ConfigError(f'dimse.allowed[{i}].host must be an IP address or "*"', path)
        out.append(AllowedPeer(item["ae_title"].strip(), host))
    return tuple(out)


def _destination(i: int, item: Any, path: Path, resolve) -> Destination:
    table = _typed(f"destinations[{i}]", item, _DEST, path)
    for key in ("name", "kind"):
        if key not in table:
            raise ConfigError(f"destinations[{i}] needs {key}", path)
    values = dict(table)
    if "token_file" in values:
        values["token_file"] = resolve(Path(values["token_file"]), path)
    if "timeout_s" in values:
        values["timeout_s"] = float(values["timeout_s"])
    return Destination(**values)


def check(s: DicomSettings, path: Path | None) -> None:
    if not (math.isfinite(s.quiet_period_s) and s.quiet_period_s >= 0):
        raise ConfigError(f"dicom.quiet_period_s must be >= 0 seconds, got {s.quiet_period_s!r}", path)
    if not AE_TITLE.match(s.ae_title.strip() or "-"):
        raise ConfigError(f"dimse.ae_title must be 1-16 printable characters, got {s.ae_title!r}", path)
    if not 0 < s.scp_port < 65536:
        raise ConfigError(f"dimse.port must be 1..65535, got {s.scp_port}", path)
    if s.max_associations < 1:
        raise ConfigError("dimse.max_associations must be >= 1", path)
    if s.scp and not s.allowed:
        raise ConfigError("dimse.enabled = true needs [[dimse.allowed]] ae_title = ..., host = ... (senders)", path)
    for peer in s.allowed:
        if not AE_TITLE.match(peer.ae_title):
            raise ConfigError(f"dimse.allowed: bad AE title {peer.ae_title!r}", path)
    if s.max_attempts < 1:
        raise ConfigError("delivery.max_attempts must be >= 1", path)
    for name in ("backoff_s", "max_backoff_s", "poll_s"):
        value = getattr(s, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"delivery.{name} must be > 0 seconds, got {value!r}", path)
    names = [d.name for d in s.destinations]
    if len(set(names)) != len(names):
        raise ConfigError("destination names must be unique", path)
    for d in s.destinations:
        where = f"destination {d.name!r}"
        if not DESTINATION_NAME.match(d.name):
            raise ConfigError(f"{where}: a name is 1-64 characters of A-Z a-z 0-9 . _ -", path)
        if d.kind not in DESTINATION_KINDS:
            raise ConfigError(f"{where}: kind must be one of {', '.join(DESTINATION_KINDS)}, got {d.kind!r}", path)
        if d.kind in ("stow", "webhook"):
            if not d.url or not d.url.startswith(("http://", "https://")):
                raise ConfigError(f'{where}: kind {d.kind} needs url = "http(s)://..."', path)
        else:
            if not (d.ae_title and d.host and d.port):
                raise ConfigError(f"{where}: kind cstore needs ae_title, host and port", path)
            if not AE_TITLE.match(d.ae_title) or not 0 < d.port < 65536:
                raise ConfigError(f"{where}: bad ae_title or port", path)
        if not (math.isfinite(d.timeout_s) and d.timeout_s > 0):
            raise ConfigError(f"{where}: timeout_s must be > 0", path)


def read_destination_token(d: Destination) -> str | None:
    if d.token_file is None:
        return None
    try:
        return d.token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read destination {d.name!r}'s token file ({exc.strerror})", d.token_file) from None
