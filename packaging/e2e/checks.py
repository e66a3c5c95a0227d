"""The booted end-to-end checks, run from the host against a systemd-nspawn container that has the .deb installed.

packaging/e2e/boot-test prepares the container and runs this as root with an interpreter that has edgekit (for its
stdlib-only client, edgekit.daemon.client). Every check talks to the daemon from outside: over the daemon's socket,
bind-mounted out of the container, as the numeric uid/gid of a user inside it (a forked child drops to them, so the
kernel's permission check is the one a client there gets); systemctl, journalctl and systemd-analyze run inside
through nsenter. Each step prints one line; the figures go to --json.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import io
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pydicom import dcmread
from pynetdicom import AE

from edgekit.daemon.client import Client, study_files

SERVICE = "edgekitd.service"
SOCKET = "edgekitd.socket"
# journald's MESSAGE_ID for "a start job finished" (systemd's catalog: the unit is up; for Type=notify, READY=1)
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
CLONE_NEWNET = 0x40000000
DICOM_DROPIN = "etc/systemd/system/edgekitd.service.d/dicom.conf"
# TEST-NET-1, put on the container's lo: a destination added after the drop-in was printed, so not in its list
UNLISTED = "192.0.2.1"
# Appended to the shipped config for the DICOM check: the SCP on the container's loopback, one sender, the SR back to
# a STOW-RS endpoint there; short waits so the check takes seconds.
DICOM_CONFIG = """
[dicom]
quiet_period_s = 1.0
[dimse]
enabled = true
port = 11112
[[dimse.allowed]]
ae_title = "E2E-MODALITY"
host = "127.0.0.1"
[[destinations]]
name = "pacs"
kind = "stow"
url = "http://127.0.0.1:{port}/dicom-web"
[delivery]
backoff_s = 1.0
"""
UNLISTED_DESTINATION = """
[[destinations]]
name = "unlisted"
kind = "stow"
url = "http://{host}:{port}/dicom-web"
timeout_s = 5.0
"""


class CheckFailed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


class Container:
    """Commands inside the booted container, through every namespace of its PID 1."""

    def __init__(self, leader: int, root: Path):
        self.leader, self.root = leader, root

    def run(self, *cmd: str, check_rc: bool = True, timeout: float = 120) -> str:
        out = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-a", *cmd], capture_output=True, text=True, timeout=timeout
        )
        if check_rc and out.returncode != 0:
            raise CheckFailed(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
        return out.stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        text = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def state(self, unit: str = SERVICE) -> str:
        return self.show(unit, "ActiveState")["ActiveState"]

    def journal(self, unit: str = SERVICE) -> list[dict[str, Any]]:
        text = self.run("journalctl", "--no-pager", "-o", "json", "-u", unit)
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def exposure(self, unit: str = SERVICE) -> float:
        text = self.run("systemd-analyze", "security", "--no-pager", unit, check_rc=False)
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", text)
        if m is None:
            raise CheckFailed(f"systemd-analyze security printed no score:\n{text[-2000:]}")
        return float(m.group(1))


def user_ids(root: Path, name: str) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary gids) of `name` in the container's /etc/passwd and /etc/group."""
    passwd = {f[0]: f for f in (line.split(":") for line in (root / "etc/passwd").read_text().splitlines())}
    uid, gid = int(passwd[name][2]), int(passwd[name][3])
    groups = [
        int(f[2])
        for f in (line.split(":") for line in (root / "etc/group").read_text().splitlines())
        if name in f[3].split(",")
    ]
    return uid, gid, groups


def as_user(ids: tuple[int, int, list[int]], fn: Callable[[], Any]) -> Any:
    """`fn()` in a forked child that has dropped to these ids; its result or its exception, pickled back."""
    uid, gid, groups = ids
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges for good, then call
        os.close(r)
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            result: Any = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - carried to the parent
            result = ("err", exc)
        with os.fdopen(w, "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "err":
        raise value
    return value


def in_box_network(leader: int, fn: Callable[[], Any]) -> Any:
    """`fn()` on a thread moved into the container's network namespace: setns(CLONE_NEWNET) is per thread and the
    threads it starts inherit it, so the sockets `fn` opens are the container's (its loopback, not the host's)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            with open(f"/proc/{leader}/ns/net", "rb") as ns:
                if ctypes.CDLL(None, use_errno=True).setns(ns.fileno(), CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into the container's network: {os.strerror(err)}")
            out["ok"] = fn()
        except BaseException as exc:  # noqa: BLE001 - carried to the caller
            out["err"] = exc

    th = threading.Thread(target=run)
    th.start()
    th.join()
    if "err" in out:
        raise out["err"]
    return out["ok"]


class StowReceiver:
    """A STOW-RS endpoint on the container's loopback: keeps each POST (path, Content-Type, body), answers 200."""

    def __init__(self, leader: int, host: str = "127.0.0.1"):
        self.posts: list[tuple[str, str, bytes]] = []
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                posts.append((self.path, self.headers.get("Content-Type", ""), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = in_box_network(leader, lambda: ThreadingHTTPServer((host, 0), Handler))
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def cstore(path: Path, port: int, calling: str) -> int:
    """C-STORE one file to edgekitd's SCP on 127.0.0.1 (call it through in_box_network); the DIMSE status."""
    ds = dcmread(path)
    ae = AE(ae_title=calling)
    ae.add_requested_context(ds.SOPClassUID, ds.file_meta.TransferSyntaxUID)
    assoc = ae.associate("127.0.0.1", port, ae_title="EDGEKIT")
    check(assoc.is_established, f"the SCP on 127.0.0.1:{port} did not accept {calling}'s association")
    try:
        return int(assoc.send_c_store(ds).Status)
    finally:
        assoc.release()


def stowed_instance(content_type: str, body: bytes):
    """The one DICOM part of a multipart/related STOW-RS body, read."""
    m = re.search(r"boundary=\"?([^\";]+)", content_type)
    check(content_type.startswith("multipart/related") and m is not None, f"not a STOW-RS body: {content_type}")
    parts = [p for p in body.split(b"--" + m.group(1).encode())[1:] if p.strip() not in (b"", b"--")]
    check(len(parts) == 1, f"{len(parts)} parts in the STOW-RS body (want 1)")
    return dcmread(io.BytesIO(parts[0].split(b"\r\n\r\n", 1)[1].removesuffix(b"\r\n")))


class Steps:
    def __init__(self):
        self.figures: dict[str, Any] = {}
        self.passed: list[str] = []
        self.t0 = time.monotonic()

    def ok(self, name: str, detail: str) -> None:
        self.passed.append(name)
        print(f"[ ok ] {name}: {detail}  (t+{time.monotonic() - self.t0:.0f} s)", flush=True)


def wait_for(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - t0


def ready(client: Client) -> dict[str, Any] | None:
    """The ready endpoint's JSON when it answers 200, else None (503 while loading, or no answer)."""
    try:
        r = client.get("/v2/health/ready", timeout=10)
    except OSError:
        return None
    return r.json() if r.status == 200 else None


def ingest_workers(box: Container, main_pid: str) -> list[str]:
    """The command lines of edgekitd's children that are ingest workers (`python -m edgekit.ingest.workers FD`):
    the shipped unit's sandbox (seccomp filter, NoNewPrivileges, the memfd the frames travel in) must let them run,
    or every study would be decoded on the daemon's own threads, holding the GIL its server needs."""
    children = box.run("sh", "-c", f"cat /proc/{main_pid}/task/*/children").split()
    lines = []
    for pid in children:
        cmdline = box.run("cat", f"/proc/{pid}/cmdline", check_rc=False).replace("\0", " ").strip()
        if "edgekit.ingest.workers" in cmdline:
            lines.append(cmdline)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, required=True, help="the container's root directory")
    p.add_argument("--leader", type=int, required=True, help="host pid of the container's PID 1")
    p.add_argument("--socket", type=Path, required=True, help="host path of the daemon's socket")
    p.add_argument("--member", default="reporter", help="a user in the edgekit group, inside the container")
    p.add_argument("--outsider", default="outsider", help="a user outside it")
    p.add_argument("--reports", type=int, default=5, help="reports timed for the latency figure")
    p.add_argument("--jobs", type=int, default=12, help="durable jobs in flight at the kill -9")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()

    box = Container(args.leader, args.root)
    steps = Steps()
    member, outsider = user_ids(args.root, args.member), user_ids(args.root, args.outsider)
    client = Client(args.socket, timeout=300)
    samples_in_box = box.run(
        "/usr/lib/edgekit/bin/python", "-c", "from importlib.resources import files; print(files('edgekit.models'))"
    ).strip()
    samples = args.root / samples_in_box.lstrip("/") / "samples"
    ct = study_files(samples / "ct_chest")
    cr = study_files(samples / "cr_chest" / "image.dcm")

    try:
        # --- the container itself ----------------------------------------------------------------------------------
        links = [ln.split(":")[0].strip() for ln in box.run("cat", "/proc/net/dev").splitlines()[2:]]
        check(links == ["lo"], f"the container should have only loopback, has {links}")
        steps.ok("private network", "the container's only link is lo")

        # --- socket activation and readiness -----------------------------------------------------------------------
        check(box.state(SOCKET) == "active", "edgekitd.socket is not active after boot")
        check(box.state() == "inactive", f"edgekitd.service is {box.state()} before any request (want inactive)")
        steps.ok("socket only at boot", "edgekitd.socket active, edgekitd.service inactive")

        t_first = time.monotonic()
        first = as_user(member, lambda: client.get("/v2/health/ready", timeout=300))
        answered_s = time.monotonic() - t_first
        seen = {first.status}
        while box.state() == "activating":
            r = as_user(member, lambda: client.get("/v2/health/ready", timeout=30))
            seen.add(r.status)
            time.sleep(0.05)
        to_ready_s = time.monotonic() - t_first
        check(box.state() == "active", f"edgekitd.service is {box.state()} after activation (want active)")
        status_at_ready = as_user(member, lambda: client.get("/v2/health/ready", timeout=30))
        check(status_at_ready.status == 200, f"active but /v2/health/ready answers {status_at_ready.status}")
        steps.ok(
            "socket activation",
            f"the first request started edgekitd (answered {first.status} in {answered_s:.1f} s; active "
            f"{to_ready_s:.1f} s after it)",
        )
        entries = box.journal()
        warmed = [e for e in entries if "warmed in" in str(e.get("MESSAGE", ""))]
        started = [e for e in entries if e.get("MESSAGE_ID") == UNIT_STARTED]
        check(bool(warmed) and bool(started), "no 'warmed in' line or no start-job-done entry in the journal")
        warm_us, started_us = int(warmed[0]["__MONOTONIC_TIMESTAMP"]), int(started[0]["__MONOTONIC_TIMESTAMP"])
        check(warm_us <= started_us, "systemd saw READY=1 before the daemon logged the warm-up")
        steps.ok(
            "READY only once warm",
            f"'{warmed[0]['MESSAGE']}' logged {(started_us - warm_us) / 1e3:.0f} ms before systemd's 'Started'; "
            f"while activating the ready endpoint answered {sorted(seen)}",
        )
        steps.figures["time_to_ready_s"] = round(to_ready_s, 2)
        main_pid = box.show(SERVICE, "MainPID")["MainPID"]
        limits = box.run("cat", f"/proc/{main_pid}/limits")
        nofile = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits, re.M)
        check(nofile is not None and nofile.groups() == ("4096", "4096"), f"edgekitd's open files limit: {limits}")
        steps.ok("LimitNOFILE", "edgekitd runs with 4096 open files (soft and hard)")
        cpuinfo = [e["MESSAGE"] for e in entries if "processor information" in str(e.get("MESSAGE", ""))]
        check(not cpuinfo, f"ONNX Runtime cannot read /proc/cpuinfo under the unit's sandbox: {cpuinfo[:1]}")

        # --- permission: group members only ----------------------------------------------------------------------
        latencies = []
        for _ in range(args.reports):
            t = time.perf_counter()
            r = as_user(member, lambda: client.post_study("/v1/reports", ct, {"prompt": "Cough and fever."}))
            latencies.append(time.perf_counter() - t)
            check(r.status == 200, f"report as a group member: {r.status} {r.body[:300]!r}")
        report = r.json()
        text = json.dumps(report)
        check("findings" in text.lower() or "impression" in text.lower(), f"no report text in {text[:300]}")
        steps.figures["report_latency_s"] = {
            "median": round(statistics.median(latencies), 3),
            "min": round(min(latencies), 3),
            "max": round(max(latencies), 3),
            "n": len(latencies),
            "study": "ct_chest (bundled sample), default variant, over the Unix socket",
        }
        steps.ok(
            "report as a group member",
            f"{args.reports} reports for ct_chest, median {statistics.median(latencies) * 1e3:.0f} ms "
            f"(min {min(latencies) * 1e3:.0f}, max {max(latencies) * 1e3:.0f})",
        )

        workers = ingest_workers(box, box.show(SERVICE, "MainPID")["MainPID"])
        check(bool(workers), "no ingest worker process under edgekitd after the reports (studies decoded in-process?)")
        steps.ok("ingest in worker processes", f"{len(workers)} under edgekitd's MainPID: {workers[0]}")

        def outsider_connects() -> str:
            try:
                client.get("/v2/health/live", timeout=10)
            except PermissionError as exc:
                return errno.errorcode.get(exc.errno, str(exc.errno))
            return "connected"

        got = as_user(outsider, outsider_connects)
        check(got == "EACCES", f"a user outside the edgekit group got {got} (want EACCES)")
        steps.ok("outsider refused", "a user outside the edgekit group gets EACCES on connect")

        # --- reload ---------------------------------------------------------------------------------------------
        conf = args.root / "etc/edgekit/edgekitd.toml"
        original = conf.read_text()
        check("max_queue = 16" in original, "the shipped config no longer says max_queue = 16")
        pid = box.show(SERVICE, "MainPID")["MainPID"]
        conf.write_text(original.replace("max_queue = 16", "max_queue = 7"))
        box.run("systemctl", "reload", SERVICE)
        took = wait_for(lambda: (ready(client) or {}).get("max_queue") == 7, 60, "max_queue 7 after reload")
        check(box.show(SERVICE, "MainPID")["MainPID"] == pid, "reload restarted the daemon")
        conf.write_text(original)
        box.run("systemctl", "reload", SERVICE)
        wait_for(lambda: (ready(client) or {}).get("max_queue") == 16, 60, "max_queue 16 after the second reload")
        steps.ok("systemctl reload", f"max_queue 16 -> 7 in {took:.1f} s, same MainPID {pid}; and back")

        # --- stop drains ----------------------------------------------------------------------------------------
        answer: dict[str, Any] = {}

        def long_report() -> None:
            try:
                r = client.post_study("/v1/reports", ct, {"prompt": "Follow-up.", "max_new_tokens": "512"})
                answer["status"] = r.status
            except OSError as exc:
                answer["status"] = repr(exc)
            answer["at"] = time.monotonic()

        for _attempt in range(5):  # the stop must land while a report runs; a report that ended first is retried
            wait_for(lambda: ready(client) is not None, 300, "edgekitd ready (started by the request)")
            answer.clear()
            th = threading.Thread(target=long_report)
            th.start()
            with contextlib.suppress(CheckFailed):
                wait_for(lambda: (ready(client) or {}).get("running") == 1, 10, "a running report", every=0.02)
            t_stop = time.monotonic()
            box.run("systemctl", "stop", SERVICE, timeout=120)
            stop_s = time.monotonic() - t_stop
            th.join(60)
            if answer.get("at", 0) > t_stop:
                break
        else:
            raise CheckFailed("no report was still running when the stop began (5 tries)")
        props = box.show(SERVICE, "ActiveState", "Result", "ExecMainStatus")
        check(answer.get("status") == 200, f"the report running at the stop got {answer.get('status')} (want 200)")
        check(props["Result"] == "success" and props["ExecMainStatus"] == "0", f"stop ended with {props}")
        drained = [e["MESSAGE"] for e in box.journal() if "stopped: drained=" in str(e.get("MESSAGE", ""))]
        check(bool(drained) and "drained=True" in drained[-1], f"no 'drained=True' in the journal: {drained}")
        steps.ok(
            "systemctl stop drains",
            f"a report running when the stop began finished (200, {answer['at'] - t_stop:.1f} s into the stop); "
            f"stop took {stop_s:.1f} s, exit 0: '{drained[-1]}'",
        )

        # --- kill -9 loses no accepted job ------------------------------------------------------------------------
        wait_for(lambda: ready(client) is not None, 300, "edgekitd to come back on the next request")
        ids = []
        for i in range(args.jobs):
            r = client.post_study(
                "/v1/jobs", cr, {"prompt": f"job {i}", "max_new_tokens": "120"}, headers={"Idempotency-Key": f"e2e-{i}"}
            )
            check(r.status == 202, f"job {i}: {r.status} {r.body[:200]!r}")
            ids.append(r.json()["id"])
        restarts = int(box.show(SERVICE, "NRestarts")["NRestarts"])
        box.run("systemctl", "kill", "--signal=SIGKILL", SERVICE)
        wait_for(lambda: int(box.show(SERVICE, "NRestarts")["NRestarts"]) > restarts, 60, "systemd's restart")
        wait_for(lambda: ready(client) is not None, 300, "edgekitd ready after the restart")
        recovered = ready(client)["recovered_jobs"]
        check(recovered >= 1, "every job had finished before the kill: the check proved nothing")

        def all_done() -> bool:
            return all(client.get(f"/v1/jobs/{i}").json()["state"] in ("succeeded", "failed") for i in ids)

        took = wait_for(all_done, 600, "every accepted job to finish", every=0.5)
        states = [client.get(f"/v1/jobs/{i}").json()["state"] for i in ids]
        check(states == ["succeeded"] * len(ids), f"after the kill -9: {states}")
        steps.ok(
            "kill -9 loses no accepted job",
            f"{len(ids)} accepted, SIGKILL, systemd restarted it, {recovered} recovered, all {len(ids)} succeeded "
            f"({took:.0f} s)",
        )

        # --- exposure -----------------------------------------------------------------------------------------------
        score = box.exposure()
        check(score <= 1.0, f"systemd-analyze security: {score} (want <= 1.0)")
        dropin = args.root / "etc/systemd/system/edgekitd.service.d/gpu.conf"
        dropin.parent.mkdir(parents=True, exist_ok=True)
        dropin.write_bytes((args.root / "usr/share/edgekit/systemd/edgekitd-gpu.conf").read_bytes())
        box.run("systemctl", "daemon-reload")
        try:
            gpu = box.exposure()
        finally:
            dropin.unlink()
            dropin.parent.rmdir()
            box.run("systemctl", "daemon-reload")
        check(gpu <= 2.0, f"systemd-analyze security with the GPU drop-in: {gpu} (want <= 2.0)")
        steps.figures["exposure"] = {"installed_unit": score, "with_gpu_dropin": gpu}
        steps.ok("systemd-analyze security", f"installed unit {score}, with the GPU drop-in {gpu}")

        # --- DICOM networking: blocked by the unit, opened by the printed drop-in -------------------------------
        receiver = StowReceiver(args.leader)
        subprocess.run(
            ["nsenter", "-t", str(args.leader), "-n", "ip", "addr", "add", f"{UNLISTED}/32", "dev", "lo"], check=True
        )
        unlisted = StowReceiver(args.leader, UNLISTED)
        try:
            conf.write_text(original + DICOM_CONFIG.format(port=receiver.port))
            box.run("systemctl", "stop", SERVICE, timeout=120)
            # --no-block: a start that fails is retried (Restart=on-failure), and its job stays open meanwhile
            box.run("systemctl", "start", "--no-block", SERVICE)

            def exited_2() -> bool:
                return box.show(SERVICE, "ExecMainStatus")["ExecMainStatus"] == "2"

            wait_for(exited_2, 120, "edgekitd to exit 2 under the shipped unit", every=0.5)
            box.run("systemctl", "stop", SERVICE, timeout=120)  # and no more retries
            refused = [e["MESSAGE"] for e in box.journal() if "cannot bind the DICOM SCP" in str(e.get("MESSAGE"))]
            check(bool(refused), "edgekitd exited 2 under the shipped unit, but not for the SCP's socket")
            steps.ok("the shipped unit blocks DICOM", f"edgekitd exits 2 without the drop-in: '{refused[-1]}'")

            dropin_text = box.run("edgekitd", "--config", "/etc/edgekit/edgekitd.toml", "--print-dicom-dropin")
            check("IPAddressAllow=localhost" in dropin_text, f"the printed drop-in:\n{dropin_text}")
            dicom_dropin = args.root / DICOM_DROPIN
            dicom_dropin.parent.mkdir(parents=True, exist_ok=True)
            dicom_dropin.write_text(dropin_text)
            # a destination the drop-in does not list: reachable from the container (the control), not from edgekitd
            conf.write_text(conf.read_text() + UNLISTED_DESTINATION.format(host=UNLISTED, port=unlisted.port))
            in_box_network(args.leader, lambda: urllib.request.urlopen(f"http://{UNLISTED}:{unlisted.port}/", b"", 10))
            check(len(unlisted.posts) == 1, f"the control POST to {UNLISTED} did not arrive")
            unlisted.posts.clear()
            box.run("systemctl", "daemon-reload")
            box.run("systemctl", "reset-failed", SERVICE)
            box.run("systemctl", "start", SERVICE, timeout=300)
            image = samples / "cr_chest" / "image.dcm"
            t = time.monotonic()
            status = in_box_network(args.leader, lambda: cstore(image, 11112, "E2E-MODALITY"))
            check(status == 0x0000, f"C-STORE status {status:#06x} (want 0x0000)")
            wait_for(lambda: bool(receiver.posts), 180, "the SR's STOW-RS delivery", every=0.2)
            path, ctype, body = receiver.posts[0]
            sr = stowed_instance(ctype, body)
            check(path == "/dicom-web/studies", f"STOW-RS went to {path}")
            same_study = sr.StudyInstanceUID == dcmread(image).StudyInstanceUID
            check(sr.Modality == "SR" and same_study, "the STOW-RS part is not the SR of the study sent")

            def deliveries() -> dict[str, dict[str, Any]]:
                jobs = client.get("/v1/jobs").json()["jobs"]
                return {x["destination"]: x for j in jobs for x in j.get("deliveries", [])}

            wait_for(lambda: deliveries().get("pacs", {}).get("state") == "delivered", 60, "pacs marked delivered")
            took = time.monotonic() - t
            wait_for(lambda: deliveries().get("unlisted", {}).get("attempts", 0) >= 1, 60, "a try at 'unlisted'")
            blocked = deliveries()["unlisted"]
            failed = blocked["state"] != "delivered" and "cannot reach" in blocked.get("last_error", "")
            check(
                failed and not unlisted.posts,
                f"edgekitd reached {UNLISTED}, which the drop-in does not list: {blocked}",
            )
            dicom_score = box.exposure()
            check(dicom_score <= 1.5, f"systemd-analyze security with the DICOM drop-in: {dicom_score} (want <= 1.5)")
            steps.figures["exposure"]["with_dicom_dropin"] = dicom_score
            steps.figures["cstore_to_stow_s"] = round(took, 2)
            steps.ok(
                "DICOM drop-in",
                f"C-STORE in on 127.0.0.1:11112, the SR out by STOW-RS to 127.0.0.1:{receiver.port} in {took:.1f} s; "
                f"{UNLISTED} (not listed) refused: '{blocked['last_error']}'; systemd-analyze security {dicom_score}",
            )
        finally:
            receiver.close()
            unlisted.close()
            conf.write_text(original)
    except CheckFailed as exc:
        print(f"[FAIL] {exc}", flush=True)
        with contextlib.suppress(Exception):
            print(box.run("journalctl", "--no-pager", "-n", "60", "-u", SERVICE, check_rc=False), flush=True)
        return 1
    finally:
        steps.figures["passed"] = steps.passed
        if args.json:
            args.json.write_text(json.dumps(steps.figures, indent=2) + "\n")
    print(f"boot-test: all {len(steps.passed)} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
