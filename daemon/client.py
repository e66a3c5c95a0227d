"""A small HTTP client for edgekitd over its Unix socket (stdlib only), for scripts, tests and the bench.

No extra dependency on a client library: `http.client` with a Unix-socket connect, plus multipart encoding.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)

    @property
    def error_code(self) -> str | None:
        try:
            return self.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return None


def multipart(
    fields: dict[str, str] | None = None, files: list[tuple[str, bytes, str]] | None = None, field_name: str = "files"
) -> tuple[bytes, str]:
    """(body, content type) for form `fields` and `files` given as (filename, bytes, content type)."""
    boundary = uuid.uuid4().hex
    out = bytearray()
    for key, value in (fields or {}).items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n').encode()
    for name, data, ctype in files or []:
        out += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field_name}"; filename="{name}"\r\n'
            f"Content-Type: {ctype}\r\n\r\n"
        ).encode()
        out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def study_files(path: str | Path) -> list[tuple[str, bytes, str]]:
    """The upload for a study on disk: a folder's files, or one file (zip, video or DICOM)."""
    path = Path(path)
    paths = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".dcm") if path.is_dir() else [path]
    types = {".zip": "application/zip", ".mp4": "video/mp4", ".dcm": "application/dicom"}
    return [(p.name, p.read_bytes(), types.get(p.suffix.lower(), "application/octet-stream")) for p in paths]


class Client:
    def __init__(self, socket_path: str | Path, timeout: float = 60.0):
        self.socket_path, self.timeout = str(socket_path), timeout

    def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        conn = UnixConnection(self.socket_path, timeout or self.timeout)
        try:
            conn.request(method, url, body=body, headers=headers or {})
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def get(self, url: str, **kw) -> Reply:
        return self.request("GET", url, **kw)

    def post_study(
        self,
        url: str,
        files: list[tuple[str, bytes, str]],
        fields: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        **kw,
    ) -> Reply:
        body, ctype = multipart(fields, files)
        return self.request("POST", url, body=body, headers={"Content-Type": ctype, **(headers or {})}, **kw)

    def report(self, study: str | Path, prompt: str = "", **fields) -> Reply:
        return self.post_study("/v1/reports", study_files(study), {"prompt": prompt, **fields})

    def wait_job(self, job_id: str, timeout: float = 60.0) -> dict:
        """`GET /v1/jobs/{id}` until the job has succeeded or failed; its JSON."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(f"/v1/jobs/{job_id}").json()
            if job["state"] in ("succeeded", "failed"):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(0.05)

    def put_json(self, url: str, data) -> Reply:
        return self.request("PUT", url, body=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
