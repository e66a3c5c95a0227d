"""Helpers for tests and the bench: a real PACS (Orthanc with its DICOMweb plugin) and DCMTK, from Debian's packages.

Orthanc runs from a config written here (never the system service's): storage in a private folder, HTTP and
DICOM ports chosen free, HTTP refused from other hosts, C-STORE accepted only from the modalities it is given.
Orthanc 1.10 has no bind-address option, so "loopback only" is enforced by those two checks, not by the socket.
`missing()` names the Debian package to install when a tool is absent, so tests can skip with it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

DICOMWEB_PLUGIN_DIRS = (Path("/usr/share/orthanc/plugins"), Path("/usr/lib/orthanc"))
TOOLS = {"Orthanc": "orthanc", "storescu": "dcmtk", "echoscu": "dcmtk", "dcmdump": "dcmtk"}


def dicomweb_plugin() -> Path | None:
    for folder in DICOMWEB_PLUGIN_DIRS:
        for path in sorted(folder.glob("libOrthancDicomWeb.so*")) if folder.is_dir() else []:
            return path
    return None


@functools.cache
def tool(name: str) -> str | None:
    """The path of a Debian tool. pynetdicom installs its own `storescu`/`echoscu` Python scripts into a venv's
    bin, which would shadow DCMTK's on PATH: only executables (ELF binaries, not scripts) count."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = shutil.which(name, path=folder) if folder else None
        if path is None:
            continue
        with open(path, "rb") as f:
            if f.read(4) == b"\x7fELF":
                return path
    return None


def missing(*tools: str) -> str | None:
    """'install Debian package X (tool Y is missing)' for the first missing tool, else None."""
    for name in tools:
        if name == "dicomweb-plugin":
            if dicomweb_plugin() is None:
                return "install Debian package orthanc-dicomweb (Orthanc's DICOMweb plugin is missing)"
        elif tool(name) is None:
            return f"install Debian package {TOOLS[name]} ({name} is missing)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Orthanc:
    """`Orthanc <config>` in a subprocess; `modalities` maps a name to (AE title, host, port) it may talk to."""

    def __init__(self, root: Path, *, aet: str = "ORTHANC", modalities: dict[str, tuple[str, str, int]] | None = None):
        self.root = Path(root)
        self.aet = aet
        self.http_port, self.dicom_port = free_port(), free_port()
        self.modalities = modalities or {}
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "orthanc.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def dicomweb(self) -> str:
        return f"{self.url}/dicom-web"

    def config(self) -> dict[str, Any]:
        plugin = dicomweb_plugin()
        return {
            "Name": "edgekit-test-pacs",
            "StorageDirectory": str(self.root / "storage"),
            "IndexDirectory": str(self.root / "storage"),
            "HttpPort": self.http_port,
            "DicomPort": self.dicom_port,
            "DicomAet": self.aet,
            "RemoteAccessAllowed": False,
            "AuthenticationEnabled": False,
            "DicomAlwaysAllowStore": False,
            "DicomAlwaysAllowEcho": False,
            "DicomCheckCalledAet": True,
            "DicomModalities": {name: list(m) for name, m in self.modalities.items()},
            "Plugins": [str(plugin)] if plugin else [],
            "DicomWeb": {"Enable": True, "Root": "/dicom-web/", "EnableWado": False},
            "StableAge": 1,
            "SaveJobs": False,
            "HttpThreadsCount": 8,
        }

    def start(self, timeout: float = 30.0) -> Orthanc:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "orthanc.json"
        path.write_text(json.dumps(self.config(), indent=2))
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [tool("Orthanc") or "Orthanc", str(path)], stdout=self._logf, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Orthanc exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                self.get("/system")
                return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"Orthanc not up after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self._logf.close()

    def __enter__(self) -> Orthanc:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- REST -------------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json") -> bytes:
        req = urllib.request.Request(self.url + path, data=body, method=method, headers={"Content-Type": ctype})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read()

    def get(self, path: str) -> Any:
        return json.loads(self.request("GET", path))

    def post(self, path: str, data: Any) -> Any:
        return json.loads(self.request("POST", path, json.dumps(data).encode()) or b"null")

    def find(self, level: str = "Instance", **query: str) -> list[str]:
        """Orthanc ids of the resources matching a DICOM query (`/tools/find`)."""
        return self.post("/tools/find", {"Level": level, "Query": query})

    def sr_instances(self, study_uid: str) -> list[str]:
        return self.find("Instance", StudyInstanceUID=study_uid, Modality="SR")

    def instance_file(self, orthanc_id: str) -> bytes:
        return self.request("GET", f"/instances/{orthanc_id}/file")

    def wait_sr(self, study_uid: str, timeout: float = 60.0, count: int = 1) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.sr_instances(study_uid)
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise TimeoutError(f"no SR of the study in Orthanc after {timeout} s")
