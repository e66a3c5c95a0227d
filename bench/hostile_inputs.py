"""Hostile inputs against a running edgekitd: small requests with big consequences, each measured on its own.

What it measures, per case (and per variant of a case, one table row each): the HTTP statuses the daemon answered, its
peak RSS over idle (VmHWM after resetting it with /proc/<pid>/clear_refs, and VmRSS sampled every 20 ms; the larger;
both summed over the daemon and its ingest worker processes), the wall time, whether GET /v2/health/ready stayed 200
throughout (probed every 0.5 s, 2 s timeout, from a thread), and what the daemon logged. Every case runs against a fresh
edgekitd (its own state dir and log, a tiny random-weights model, the config's defaults except where a case says), is
bounded in time and request count, and stops by itself; an RSS watchdog past 6 GiB SIGKILLs the largest process of the
tree, as the kernel's OOM killer would at the unit's MemoryMax ("killed by watchdog at X GiB"), a daemon that dies is
reported and restarted. The daemon gets the RLIMIT_NOFILE its systemd unit gives it (the unit's LimitNOFILE=, else
systemd's default soft limit 1024; `--daemon-nofile` overrides). The inputs are written by bench/hostile_corpus.py. To
measure another tree (the code before a fix), run from outside the checkout with PYTHONPATH=that tree.

    python bench/hostile_inputs.py [--only CASE[,CASE]] [--out bench/hostile_inputs.json] [--cases]

Targets (the issue's): peak <= 1 GiB over idle at default settings; 0 x 5xx; 0 health-probe failures during slow bodies;
a normal one-instance STOW-RS < 1 s during a large ingest; 0 PHI hits in the log; a poison study ends as one failed job:
`ingest_crashed` when only its ingest worker is killed, else quarantined after at most 5 restarts. Needs root for two
cases: disk_full mounts a tmpfs (skipped with the reason otherwise) and slow_bodies raises this process's RLIMIT_NOFILE
up to its hard limit.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import http.client
import http.server
import json
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hostile_corpus as hc
from pydicom.uid import generate_uid

from edgekit.daemon.client import Client, Reply, multipart
from edgekit.daemon.testing import DaemonProcess, proc_kib, proc_kib_one, process_tree, write_tiny_model
from edgekit.daemon.testing_pacs import free_port

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
KILL_AT = 6 * GiB  # the watchdog's default limit; the machine has 24 GB and other work on it
ROW_BUDGET_S = 60.0  # each row (a case, or one variant of it) ends by itself within this
SETTLE_S = 20.0  # after a row, the daemon gets this long to finish what it still does (queue, inbox)
PROBE_EVERY_S, PROBE_TIMEOUT_S = 0.5, 2.0
LOGGED_STATUS = re.compile(r"INFO (?:POST|PUT|DELETE|GET (?!/v2/health/ready)).* -> (\d{3}) ")  # the daemon's own
TARGETS = {
    "peak_over_idle_mib": 1024,
    "5xx": 0,  # other than 503 (busy, with Retry-After) and 507 (disk full)
    "slow_bodies_probe_failures": 0,
    "stow_during_ingest_s": 1.0,
    "phi_hits": 0,
    "poison_max_restarts": 5,
}


# --- the daemon's memory ----------------------------------------------------------------------------------------
def reset_hwm(pid: int) -> bool:
    """Reset the peak (VmHWM) of `pid` and its descendants to their current RSS; False where the kernel or our
    rights refuse."""
    try:
        for p in process_tree(pid):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                Path(f"/proc/{p}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Monitor(threading.Thread):
    """Samples the current daemon's VmRSS (with its workers') every 20 ms (its max since `reset()`) and SIGKILLs it
    past `limit`."""

    def __init__(self, run: Run):
        super().__init__(name="rss-watchdog", daemon=True)
        self.run_, self.limit = run, KILL_AT
        self.max_kib = 0
        self.kills: list[tuple[int, int]] = []  # (pid, RSS KiB when killed)
        self.killed: set[int] = set()
        self.stop = threading.Event()

    def reset(self, rss_kib: int) -> None:
        self.max_kib = rss_kib

    def run(self) -> None:
        while not self.stop.wait(0.02):
            d = self.run_.daemon
            if d is None or d.proc is None or d.proc.poll() is not None:
                continue
            rss = proc_kib(d.proc.pid).get("VmRSS", 0)
            self.max_kib = max(self.max_kib, rss)
            if rss * 1024 > self.limit:
                victim = max(process_tree(d.proc.pid), key=lambda p: proc_kib_one(p).get("VmRSS", 0))
                if victim in self.killed:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                self.killed.add(victim)
                self.kills.append((victim, rss))


class Prober(threading.Thread):
    """GET /v2/health/ready every 0.5 s on its own connection (2 s timeout): (time, status or error)."""

    def __init__(self, run: Run):
        super().__init__(name="ready-prober", daemon=True)
        self.run_ = run
        self.results: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def probe(self) -> None:
        t, d = time.monotonic(), self.run_.daemon
        if d is not None:
            try:
                outcome = str(Client(d.socket, PROBE_TIMEOUT_S).get("/v2/health/ready").status)
            except Exception as err:  # a failed probe is the measurement
                outcome = error_label(err)
            self.results.append((t, outcome))

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            self.probe()
            self.stop.wait(max(0.0, t + PROBE_EVERY_S - time.monotonic()))


def error_label(err: BaseException) -> str:
    if isinstance(err, (TimeoutError, socket.timeout)):
        return "timeout"
    if isinstance(err, (ConnectionRefusedError, FileNotFoundError)):
        return "refused"
    if isinstance(err, (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)):
        return "reset"
    if isinstance(err, OSError) and err.errno is not None:
        return errno.errorcode.get(err.errno, type(err).__name__)
    return type(err).__name__


# --- one measured row -------------------------------------------------------------------------------------------
class Row:
    def __init__(self, case: str, label: str):
        self.case, self.label = case, label
        self.statuses: Counter[str] = Counter()
        self.paths: dict[str, list[str]] = {}  # what each tagged request got (phi_in_logs names its paths)
        self.notes: list[str] = []
        self.extra: dict = {}

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def name(self) -> str:
        return f"{self.case}/{self.label}" if self.label else self.case


class Run:
    """One case: its folder, its daemon(s), the watchdog and prober, and the rows it measures."""

    def __init__(self, name: str, root: Path, bench: Bench):
        self.name, self.dir, self.bench = name, root / name, bench
        self.dir.mkdir(parents=True)
        self.tmpdir = self.dir / "tmp"  # the daemon's TMPDIR: what it leaves behind is countable
        self.tmpdir.mkdir()
        self.daemon: DaemonProcess | None = None
        self.daemons: list[DaemonProcess] = []
        self.unready: str | None = None  # why the current daemon is not ready, when a case accepts that
        self.rows: list[dict] = []
        self.row_: Row | None = None
        self.deadline = time.monotonic() + ROW_BUDGET_S
        self.monitor, self.prober = Monitor(self), Prober(self)
        self.monitor.start()
        self.prober.start()

    # daemon life
    def start_daemon(
        self,
        *,
        state: Path | None = None,
        toml: str = "",
        log_level: str | None = None,
        warm: bool = True,
        ready_s: float | None = 120.0,
    ) -> DaemonProcess:
        """A fresh edgekitd on `state` (default: the case's), serving the prebuilt bundle; the config is the
        defaults plus `toml`. Waits until ready, then sends one normal report so ingest's imports count as idle.
        `ready_s=None`: a daemon that stays unready is fine once it answers /v2/health/live (`self.unready` says
        why it is not ready)."""
        self._start_kw = {"state": state, "toml": toml, "log_level": log_level, "ready_s": ready_s}
        self.unready = None
        state = state or self.dir / "state"
        config = self.dir / f"edgekitd-{len(self.daemons)}.toml"
        config.write_text(f'[[variants]]\nname = "default"\nbundle = "{self.bench.bundle}"\n\n{toml}')
        args = ["--log-level", log_level] if log_level else []
        d = DaemonProcess(state, config=config, extra_args=args, env={"TMPDIR": str(self.tmpdir)})
        d.log = self.dir / f"daemon-{len(self.daemons)}.log"  # outside the state dir (disk_full fills that)
        self.daemons.append(d)
        self.daemon = d
        d.start(wait_ready=None)
        if self.bench.nofile:  # set from here: preexec_fn is unsafe with the watchdog's threads running
            with contextlib.suppress(ProcessLookupError):
                hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)[1]
                limit = self.bench.nofile if hard == resource.RLIM_INFINITY else min(self.bench.nofile, hard)
                resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (limit, hard))
        try:
            d.wait_ready(ready_s or 20.0)
        except TimeoutError:
            if ready_s is not None:
                raise
            if d.client.get("/v2/health/live", timeout=5).status != 200:
                raise
            self.unready = d.client.get("/v2/health/ready", timeout=5).body.decode()[:200]
            return d
        if warm:
            d.client.post_study("/v1/reports", [("warm.dcm", hc.tiny_instance(), "application/dicom")], timeout=60)
        return d

    def restart(self) -> DaemonProcess:
        """The same daemon again (same state dir and config), not warmed: a restart after a crash."""
        return self.start_daemon(**self._start_kw, warm=False)

    def alive(self) -> bool:
        return self.daemon is not None and self.daemon.proc is not None and self.daemon.proc.poll() is None

    def stop_daemons(self) -> None:
        for d in self.daemons:
            try:
                d.stop(timeout=10)
            except subprocess.TimeoutExpired:
                d.kill()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # requests, recorded on the current row
    def record(self, outcome: str, tag: str | None = None) -> None:
        self.row_.statuses[outcome] += 1
        if tag:
            self.row_.paths.setdefault(tag, []).append(outcome)

    def request(
        self, method: str, url: str, body: bytes | None = None, headers: dict | None = None, *, timeout=None, tag=None
    ) -> Reply | None:
        t = max(1.0, min(timeout or self.left(), self.left()))
        try:
            reply = Client(self.daemon.socket, t).request(method, url, body=body, headers=headers or {})
        except Exception as err:  # timeouts and resets are outcomes to count
            self.record(error_label(err), tag)
            return None
        self.record(str(reply.status), tag)
        if reply.status >= 400 and reply.error_code:
            message = str(reply.json()["error"].get("message", ""))[:90]
            self.row_.note(f"{reply.status} {reply.error_code}: {message}")
        return reply

    def upload(self, url: str, files: list[tuple[str, bytes, str]], fields=None, **kw) -> Reply | None:
        body, ctype = multipart(fields, files)
        return self.request("POST", url, body, {"Content-Type": ctype}, **kw)

    def stow(self, parts: list[bytes], url: str = "/dicomweb/studies", *, complete: bool = False, **kw):
        body, ctype = hc.stow_body(parts)
        reply = self.request("POST", url + ("?complete=true" if complete else ""), body, {"Content-Type": ctype}, **kw)
        if reply is not None and reply.status in (202, 409):
            failed = reply.json().get("00081198", {}).get("Value", [])
            reasons = Counter(f"{f.get('00081197', {}).get('Value', ['?'])[0]:#06x}" for f in failed)
            self.row_.note("refused " + ", ".join(f"{k}x{v}" for k, v in reasons.items()))
        return reply

    def ready(self) -> dict | None:
        try:
            r = Client(self.daemon.socket, PROBE_TIMEOUT_S).get("/v2/health/ready")
            return r.json() if r.status == 200 else None
        except Exception:
            return None

    def settle(self, timeout: float = SETTLE_S) -> float | None:
        """Wait until the daemon has nothing queued, running or pending in its inbox; the seconds it took, or None
        when it was still busy (or gone) at the end."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout and self.alive() and not self.unready:
            r = self.ready()
            if r and r["queue_depth"] == 0 and r["running"] == 0 and r["pending_studies"] == 0:
                return time.monotonic() - t0
            time.sleep(0.2)
        return None

    # rows
    @contextlib.contextmanager
    def row(self, label: str = ""):
        """Measure what the body does as one table row: fresh budget, peak reset, probes and log from here."""
        if self.daemon is not None and not self.alive():  # it died in the row before: again
            self.restart()
        row = self.row_ = Row(self.name, label)
        self.deadline = time.monotonic() + ROW_BUDGET_S
        pid = self.daemon.proc.pid
        hwm_reset = reset_hwm(pid)
        idle = proc_kib(pid).get("VmRSS", 0)
        self.monitor.reset(idle)
        kills0 = len(self.monitor.kills)
        logs0 = {d.log: d.log.stat().st_size if d.log.exists() else 0 for d in self.daemons}
        n0 = len(self.daemons)
        watched = [d for d in self.daemons if d.proc.poll() is None]
        t0 = time.monotonic()
        try:
            yield row
        finally:
            took = time.monotonic() - t0
            self.prober.probe()  # a row shorter than the probe period still gets one
            settled = self.settle() if self.alive() else None
            watched += self.daemons[n0:]  # started during the row (restarts)
            self._finish(row, pid, idle, hwm_reset, kills0, logs0, watched, t0, took, settled)

    def skip(self, label: str, reason: str) -> None:
        self.rows.append(
            {"case": self.name, "label": label, "name": f"{self.name}/{label}" if label else self.name,
             "skipped": reason, "statuses": {}, "notes": [f"skipped: {reason}"]}
        )  # fmt: skip

    def _finish(self, row, pid, idle, hwm_reset, kills0, logs0, watched, t0, took, settled) -> None:
        now = proc_kib(pid) if self.alive() and self.daemon.proc.pid == pid else {}
        peak = max(self.monitor.max_kib, now.get("VmHWM", 0) if hwm_reset else 0)
        probes = [outcome for t, outcome in self.prober.results if t >= t0]
        failed = Counter(p for p in probes if p != "200")
        new_log = b""
        for d in self.daemons:
            with contextlib.suppress(OSError), open(d.log, "rb") as f:
                f.seek(logs0.get(d.log, 0))
                new_log += f.read()
        lines = new_log.decode("utf-8", "replace").splitlines()
        kills = self.monitor.kills[kills0:]
        for kpid, rss in kills:
            row.note(f"killed by watchdog at {rss / (1 << 20):.2f} GiB (pid {kpid})")
        for d in watched:  # any exit during a row is a death: the bench stops daemons between cases only
            rc = d.proc.poll()
            if rc is not None and d.proc.pid not in self.monitor.killed:
                row.note(f"daemon died (rc={rc})")
        if settled is None and self.alive() and not self.unready:
            row.note(f"still busy {SETTLE_S:.0f} s after the row")
        elif settled and settled > 1:
            row.note(f"busy {settled:.1f} s after its requests")
        tracebacks = sum("Traceback" in line for line in lines)
        if tracebacks:
            row.note(f"{tracebacks} Traceback(s) in the log")
        self.rows.append(
            {
                "case": self.name,
                "label": row.label,
                "name": row.name,
                "statuses": dict(row.statuses),
                "paths": row.paths,
                "idle_rss_mib": idle / 1024,
                "peak_rss_mib": peak / 1024,
                "peak_over_idle_mib": (peak - idle) / 1024,
                "peak_source": "VmHWM + 20 ms VmRSS samples" if hwm_reset else "20 ms VmRSS samples",
                "time_s": took,
                "settle_s": settled,
                "probes": len(probes),
                "probe_failures": dict(failed),
                "ready_held": bool(probes) and not failed,
                "log_bytes": len(new_log),
                "logged_statuses": dict(Counter(m.group(1) for m in map(LOGGED_STATUS.search, lines) if m)),
                "log_bytes_without_probe_lines": sum(len(x) + 1 for x in lines if "/v2/health/ready" not in x),
                "log_lines": len(lines),
                "tracebacks": tracebacks,
                "watchdog_kills_gib": [rss / (1 << 20) for _, rss in kills],
                "notes": row.notes,
                **row.extra,
            }
        )
        self.row_ = None

    def close(self) -> None:
        self.monitor.stop.set()
        self.prober.stop.set()
        self.stop_daemons()
        self.monitor.join(5)
        self.prober.join(5)


class Bench:
    """What every case shares: the temp root, the prebuilt bundle, the corpus folder (built lazily, cached)."""

    def __init__(self, root: Path, nofile: int):
        self.root, self.nofile = root, nofile
        self.corpus_dir = root / "corpus"
        self.corpus_dir.mkdir()
        self._made: dict[str, hc.Made] = {}
        model = write_tiny_model(root / "model")
        build = DaemonProcess(root / "build", model)
        build.start(wait_ready=600)
        build.stop()
        self.bundle = root / "build" / "bundles" / "default-cpu"
        if not (self.bundle / "manifest.json").is_file():
            raise RuntimeError(f"no bundle at {self.bundle}: {sorted((root / 'build' / 'bundles').iterdir())}")

    def corpus(self, name: str, build: Callable[[Path], hc.Made]) -> hc.Made:
        if name not in self._made:
            self._made[name] = build(self.corpus_dir / name)
        return self._made[name]


# --- cases ------------------------------------------------------------------------------------------------------
# Frames per codec bomb, 4096 x 4096 each: 16 x 16 Mpx is exactly the 256 Mpx that ingest's max_total_pixels allows.
BOMB_FRAMES = 16


def _bomb_row(run: Run, codec: str, frames: int, *, rgb: bool = False, label: str | None = None) -> None:
    name = f"{codec}-{frames}{'-rgb' if rgb else ''}.dcm"
    try:
        made = run.bench.corpus(name, lambda p: hc.codec_bomb(p, codec, frames, rgb=rgb))
    except hc.NoEncoder as err:
        print(f"  {run.name}: skipped ({err})", flush=True)
        run.skip(label or "", str(err))
        return
    data = made.path.read_bytes()
    with run.row(label or "") as row:
        row.note(made.describe())
        run.upload("/v1/reports", [(name, data, "application/dicom")])


def jpegls_bomb(run: Run) -> None:
    """JPEG-LS Lossless, 16 frames of 4096x4096 zeros (~10 KiB), grey and RGB, POST /v1/reports."""
    run.start_daemon()
    _bomb_row(run, "jpegls", BOMB_FRAMES, label="grey")
    _bomb_row(run, "jpegls", BOMB_FRAMES, rgb=True, label="rgb")


def rle_bomb(run: Run) -> None:
    """RLE Lossless, 12 frames of 4096x4096 zeros (pydicom's own encoder), POST /v1/reports."""
    run.start_daemon()
    _bomb_row(run, "rle", 12)


def jpeg2000_bomb(run: Run) -> None:
    """JPEG 2000 Lossless (pylibjpeg-openjpeg), 16 frames of 4096x4096 zeros, POST /v1/reports."""
    run.start_daemon()
    _bomb_row(run, "j2k", BOMB_FRAMES)


def jpeg_baseline_bomb(run: Run) -> None:
    """8-bit JPEG baseline (Pillow), 16 frames of 4096x4096 zeros, POST /v1/reports."""
    run.start_daemon()
    _bomb_row(run, "jpeg", BOMB_FRAMES)


def deflate_bomb(run: Run) -> None:
    """A ~1 MiB Deflated Explicit VR LE instance that inflates to 1 GiB: by STOW-RS and by POST /v1/reports."""
    made = run.bench.corpus("deflate.dcm", hc.deflate_bomb)
    data = made.path.read_bytes()
    run.start_daemon()
    with run.row("stow") as row:
        row.note(made.describe())
        run.stow([data], complete=True)
    with run.row("upload") as row:
        row.note(made.describe())
        run.upload("/v1/reports", [("deflate.dcm", data, "application/dicom")])


def zip_bomb(run: Run) -> None:
    """A ~2 MiB zip of 2000 DICOMs of one 512x512 frame each (1 GiB unpacked), POST /v1/reports."""
    made = run.bench.corpus("zipbomb.zip", lambda p: hc.series_zip(p, 2000, 512, zeros=True))
    run.start_daemon()
    with run.row() as row:
        row.note(made.describe())
        run.upload("/v1/reports", [("bomb.zip", made.path.read_bytes(), "application/zip")])


def many_part_stow(run: Run) -> None:
    """STOW-RS of 5000 tiny instances (one study, one series) in one request, complete=true."""

    def build(path: Path) -> hc.Made:
        study, series = generate_uid(), generate_uid()
        parts = [hc.tiny_instance(study, series, k) for k in range(5000)]
        body, ctype = hc.stow_body(parts)
        path.write_bytes(body)
        return hc.Made(path, len(body), sum(map(len, parts)), "5000 parts of 8x8 CT", {"ctype": ctype})

    made = run.bench.corpus("many-parts.stow", build)
    run.start_daemon()
    with run.row() as row:
        row.note(made.describe())
        headers = {"Content-Type": made.extra["ctype"]}
        t = time.perf_counter()
        reply = run.request("POST", "/dicomweb/studies?complete=true", made.path.read_bytes(), headers)
        row.extra["stow_s"] = time.perf_counter() - t
        if reply is not None and reply.status < 300:
            stored = len(reply.json().get("00081199", {}).get("Value", []))
            row.note(f"{stored} stored in {row.extra['stow_s']:.1f} s")


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def slow_bodies(run: Run, clients: int = 1100, seconds: float = 30.0) -> None:
    """1100 connections each sending POST /v1/reports headers (Content-Length 1 MiB) then 1 byte/s for 30 s."""
    nofile = raise_nofile()
    run.start_daemon()
    boundary = uuid.uuid4().hex
    head = (
        "POST /v1/reports HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {1 << 20}\r\n\r\n"
    ).encode()
    trickle = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="slow.dcm"\r\n'
        "Content-Type: application/dicom\r\n\r\n"
    ).encode() + bytes(4096)
    with run.row() as row:
        row.note(f"bench RLIMIT_NOFILE {nofile}, daemon's {run.bench.nofile or 'inherited'}")
        sel = selectors.DefaultSelector()
        open_: dict[socket.socket, bool] = {}  # socket -> answered already
        refused: Counter[str] = Counter()
        for _ in range(clients):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(run.daemon.socket))
                s.send(head)
            except OSError as err:  # a full backlog is EAGAIN on a non-blocking Unix socket
                refused[error_label(err)] += 1
                s.close()
                continue
            open_[s] = False
            sel.register(s, selectors.EVENT_READ)
        answered: Counter[str] = Counter()
        closed_by_daemon = 0
        end, pos = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            tick = time.monotonic()
            for s in list(open_):
                try:
                    s.send(trickle[pos : pos + 1])
                except BlockingIOError:
                    pass
                except OSError:
                    closed_by_daemon += 1
                    sel.unregister(s)
                    s.close()
                    del open_[s]
            pos += 1
            while (wait := tick + 1.0 - time.monotonic()) > 0:
                for key, _ in sel.select(wait):
                    s = key.fileobj
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if data and not open_[s]:
                        open_[s] = True
                        answered[data.split(b"\r\n", 1)[0].decode("latin-1")[9:12] or "?"] += 1
                    if not data:
                        closed_by_daemon += 1
                        sel.unregister(s)
                        s.close()
                        del open_[s]
        still = len(open_)
        for s in open_:
            s.close()
        sel.close()
        for status, n in answered.items():
            row.statuses[status] += n
        for label, n in refused.items():
            row.statuses[f"connect {label}"] += n
        row.extra["slow"] = {
            "clients": clients,
            "connected": clients - sum(refused.values()),
            "refused_at_connect": dict(refused),
            "answered": dict(answered),
            "closed_by_daemon": closed_by_daemon,
            "open_at_end": still,
        }
        row.note(
            f"{clients - sum(refused.values())} connected, {sum(refused.values())} refused at connect, "
            f"{closed_by_daemon} closed by the daemon, {still} still open after {seconds:.0f} s"
        )
        time.sleep(2.0)
        after = run.upload("/v1/reports", [("after.dcm", hc.tiny_instance(), "application/dicom")], timeout=20)
        row.note(f"normal request after: {after.status if after else 'no answer'}")
    run.rows[-1]["notes"].append(f"{run.rows[-1]['log_bytes']} log bytes during the case")


def aborted_uploads(run: Run, clients: int = 20) -> None:
    """20 clients send half a multipart body (/v1/reports and /v1/jobs) and close; then a normal request."""
    run.start_daemon()
    body, ctype = multipart({"prompt": ""}, [("a.dcm", hc.noise_instance(2 << 20), "application/dicom")])
    tmp_before = {p.name for p in run.tmpdir.iterdir()}

    def one(i: int) -> None:
        url = "/v1/reports" if i % 2 == 0 else "/v1/jobs"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(run.daemon.socket))
            head = f"POST {url} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
            s.sendall(head.encode() + body[: len(body) // 2])
            time.sleep(0.5)

    with run.row() as row:
        with ThreadPoolExecutor(clients) as pool:
            errors = [f.exception() for f in [pool.submit(one, i) for i in range(clients)]]
        if any(errors):
            row.note(f"{sum(e is not None for e in errors)} clients could not send: {errors[0]!r}")
        time.sleep(1.0)
        normal = [("normal.dcm", hc.tiny_instance(), "application/dicom")]
        r = run.upload("/v1/reports", normal, timeout=30, tag="normal report")
        j = run.upload("/v1/jobs", normal, timeout=30, tag="normal job")
        if j is not None and j.status == 202:
            state = Client(run.daemon.socket).wait_job(j.json()["id"], timeout=30)["state"]
            row.note(f"normal job {state}")
        row.note(f"normal report {r.status if r else 'no answer'}")
        time.sleep(1.0)
        left = sorted({p.name for p in run.tmpdir.iterdir()} - tmp_before)
        jobs_dir = run.daemon.state_dir / "jobs"
        job_dirs = list(jobs_dir.iterdir()) if jobs_dir.is_dir() else []
        jobs = Client(run.daemon.socket).get("/v1/jobs").json()["jobs"]
        row.note(f"{len(left)} leftovers in TMPDIR, {len(job_dirs)} job dirs for {len(jobs)} job rows")
    last = run.rows[-1]
    last["notes"].append(
        f"the daemon's answers as it logged them: {statuses_text(last['logged_statuses'])}; "
        f"{last['log_lines']} log lines, {last['tracebacks']} with Traceback"
    )


def disk_full(run: Run) -> None:
    """The state dir on an 8 MiB tmpfs: a 12 MiB POST /v1/jobs, then 1 MiB STOW-RS instances until full."""
    from dataclasses import fields

    from edgekit.daemon.config import DaemonConfig

    rows = [("defaults", "")]
    if "min_free_bytes" in {f.name for f in fields(DaemonConfig)}:  # a daemon with a free-space floor: also without
        rows.append(("min_free_bytes=0", "[limits]\nmin_free_bytes = 0\n"))
    for label, toml in rows:
        state = run.dir / f"state-{len(run.rows)}"
        state.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(state)]
        mounted = subprocess.run(mount, capture_output=True)
        if mounted.returncode != 0:
            run.skip(label, f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()[:200]}")
            return
        try:
            _fill_disk(run, state, label, toml)
        finally:
            run.stop_daemons()
            if subprocess.run(["umount", str(state)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(state)], capture_output=True)


def _fill_disk(run: Run, state: Path, label: str, toml: str) -> None:
    run.start_daemon(state=state, toml=toml, ready_s=None)
    with run.row(label) as row:
        if run.unready:
            row.note(f"never ready on this state dir: {run.unready}")
        free0 = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
        run.upload("/v1/jobs", [("big.dcm", hc.noise_instance(12 << 20), "application/dicom")], tag="12 MiB job")
        study, series = generate_uid(), generate_uid()
        sent = 0
        for k in range(12):
            r = run.stow([hc.noise_instance(1 << 20, study, series, k)], timeout=20, tag="1 MiB stow")
            sent += 1
            if r is None or r.status != 200:  # one more after the first refusal, then stop
                run.stow([hc.noise_instance(1 << 20, study, series, 100 + k)], timeout=20, tag="1 MiB stow")
                sent += 1
                break
        free1 = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
        after = run.upload("/v1/reports", [("after.dcm", hc.tiny_instance(), "application/dicom")], tag="after")
        row.note(
            f"{free0 >> 10} KiB free at start, {free1 >> 10} after {sent} STOW requests; normal report after: "
            f"{after.status if after else 'no answer'}"
        )
        time.sleep(12)  # the inbox's quiet period (10 s) passes: the hand-over meets the full disk
    parts = sorted(str(p.relative_to(state)) for p in state.rglob("*.part"))
    run.rows[-1]["notes"].append(f"{len(parts)} leftover .part file(s) in the state dir")
    run.rows[-1]["leftover_parts"] = parts


class _Destinations:
    """Loopback HTTP servers the daemon delivers to: a webhook that fails its first two calls then accepts, and a
    STOW-RS 'PACS' that refuses everything (409)."""

    def __init__(self):
        self.calls: Counter[str] = Counter()
        calls = self.calls

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hook = self.path.startswith("/hook")
                calls["webhook" if hook else "stow"] += 1
                status = (503 if calls["webhook"] <= 2 else 200) if hook else 409
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _c_store(port: int, datasets) -> list[str]:
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian
    from pynetdicom import AE

    ae = AE(ae_title="EKBENCHSCU")
    ae.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
    assoc = ae.associate("127.0.0.1", port, ae_title="EDGEKIT")
    if not assoc.is_established:
        return ["association refused"]
    out = []
    for ds in datasets:
        status = assoc.send_c_store(ds)
        out.append(f"0x{status.Status:04x}" if status else "no answer")
    assoc.release()
    return out


def phi_in_logs(run: Run) -> None:
    """Patient data through every path (uploads, jobs + SR, STOW-RS, C-STORE, an aborted STOW, failing
    deliveries), then the daemon's whole log grepped for each name, ID, date and raw UID."""
    phi = hc.Phi()
    dest = _Destinations()
    scp_port = free_port()
    toml = f"""[dicom]
quiet_period_s = 1.0

[dimse]
enabled = true
port = {scp_port}

[[dimse.allowed]]
ae_title = "EKBENCHSCU"
host = "127.0.0.1"

[delivery]
max_attempts = 3
backoff_s = 0.5
max_backoff_s = 1.0
poll_s = 0.2

[[destinations]]
name = "hook"
kind = "webhook"
url = "http://127.0.0.1:{dest.port}/hook"
timeout_s = 5.0

[[destinations]]
name = "refusing-pacs"
kind = "stow"
url = "http://127.0.0.1:{dest.port}/dicom-web"
timeout_s = 5.0
"""
    try:
        d = run.start_daemon(toml=toml, log_level="debug")
        up = [hc.phi_instance(phi, k, study=phi.study_c, series=phi.series_c) for k in range(2)]
        stow_a = [hc.phi_bytes(hc.phi_instance(phi, k, study=phi.study, series=phi.series)) for k in (2, 3)]
        stow_a.append(hc.phi_bytes(hc.phi_instance(phi, 4, study=phi.study, series=phi.series, long_name=True)))
        scp = [hc.phi_instance(phi, k, study=phi.study_b, series=phi.series_b) for k in (5, 6)]
        broken = hc.phi_bytes(hc.phi_instance(phi, 7, study=phi.study_c, series=phi.series_c))
        broken = broken[: len(broken) - 200]  # cut inside the pixel data
        fname = f"{phi.name}_{phi.patient_id}_{phi.birth_date}.dcm"  # exports name files after the patient
        with run.row("all paths") as row:
            run.upload("/v1/reports?format=sr", [(fname, hc.phi_bytes(up[0]), "application/dicom")], tag="report sr")
            j = run.upload("/v1/jobs", [(fname, hc.phi_bytes(up[1]), "application/dicom")], tag="job")
            if j is not None and j.status == 202:
                job_id = j.json()["id"]
                with contextlib.suppress(Exception):
                    Client(d.socket).wait_job(job_id, timeout=30)
                run.request("GET", f"/v1/jobs/{job_id}/sr", tag="job sr")
            run.upload("/v1/reports", [(fname, broken, "application/dicom")], tag="truncated upload")
            run.upload(
                "/v1/reports",
                [(f"{phi.name}/IM1.dcm", hc.phi_bytes(up[0]), "application/dicom")]
                + [(fname, broken, "application/dicom")],
                tag="series with a truncated file",
            )
            run.stow(stow_a, complete=True, tag="stow complete")
            run.stow([stow_a[0]], url=f"/dicomweb/studies/{phi.study_b}", tag="stow other study in URL")
            run.stow([broken], tag="stow truncated")
            with contextlib.suppress(Exception):  # the aborted STOW: half the body, then close
                body, ctype = hc.stow_body(stow_a)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(10)
                    s.connect(str(d.socket))
                    s.sendall(
                        f"POST /dicomweb/studies HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body[: len(body) // 2]
                    )
                    time.sleep(0.5)
                run.record("aborted", "aborted stow")
            for status in _c_store(scp_port, scp):
                run.record(f"dimse {status}", "c-store")
            # received studies become jobs after the 1 s quiet period; each has two deliveries that fail and retry
            deliveries = _wait_deliveries(run, timeout=max(5.0, run.left() - 5))
            row.note(f"deliveries: {deliveries}; destination calls {dict(dest.calls)}")
            errors = [f"{tag} {o}" for tag, outcomes in row.paths.items() for o in outcomes if o[:1] in "45"]
            row.note("4xx/5xx: " + (", ".join(errors) or "none"))
            row.extra["deliveries"] = deliveries
        run.stop_daemons()
        text = "\n".join(p.read_text("utf-8", "replace") for p in run.dir.glob("daemon-*.log"))
        needles = phi.needles()
        hits = {label: text.count(needle) for label, needle in needles.items()}
        lines = [line for line in text.splitlines() if any(n in line for n in needles.values())]
        last = run.rows[-1]
        last["phi_hits"] = hits  # occurrences per needle (the name part HOSTILE also counts inside the full name)
        last["phi_hits_total"] = len(lines)  # log lines holding any of them: the headline number
        last["phi_log_lines"] = [line[:300] for line in lines[:40]]
        found = {k: v for k, v in hits.items() if v}
        last["notes"].append(f"PHI in {len(lines)} log line(s)" + (f": {found}" if found else ""))
    finally:
        dest.close()


def _wait_deliveries(run: Run, timeout: float) -> dict[str, int]:
    """Until every delivery of every job is delivered or dead (or `timeout`): counts by state."""
    end = time.monotonic() + timeout
    states: Counter[str] = Counter()
    while time.monotonic() < end:
        try:
            jobs = Client(run.daemon.socket, 5).get("/v1/jobs").json()["jobs"]
        except Exception:
            break
        states = Counter(d["state"] for j in jobs for d in j.get("deliveries", []))
        pending = run.ready() or {}
        if states and states.get("pending", 0) == 0 and not pending.get("pending_studies"):
            break
        time.sleep(0.5)
    return dict(states)


POISON_RESTARTS = 5


def poison_study(run: Run) -> None:
    """A study whose ingest gets the daemon killed, by STOW-RS (complete=true), under an RSS watchdog; restarted on
    the same state dir up to 5 times: restarts, and what GET /v1/jobs shows at the end. Two studies: the RLE bomb
    (12 frames) killed at 1.5 GiB, and 10 such frames (inside today's 1 GiB ingest budget) killed at idle + 0.5 GiB,
    as a MemoryMax= below what ingest needs would (so the crash loop is met even where the budget refuses the bomb)."""
    for frames, label, limit in (
        (12, "rle12 kill@1.5GiB", lambda idle_kib: int(1.5 * GiB)),
        (10, "rle10 kill@idle+0.5GiB", lambda idle_kib: idle_kib * 1024 + GiB // 2),
    ):
        made = run.bench.corpus(f"rle-{frames}.dcm", lambda p, n=frames: hc.codec_bomb(p, "rle", n))
        run.stop_daemons()
        d = run.start_daemon(state=run.dir / f"state-{frames}")
        run.monitor.limit = limit(proc_kib(d.proc.pid).get("VmRSS", 0))
        try:
            with run.row(label) as row:
                row.note(made.describe())
                _poison(run, row, made.path.read_bytes())
        finally:
            run.monitor.limit = KILL_AT


def _poison(run: Run, row: Row, data: bytes) -> None:
    run.stow([data], complete=True)
    restarts, jobs = 0, None
    while run.left() > 0:
        if not run.alive():
            if restarts == POISON_RESTARTS:
                break
            restarts += 1
            with contextlib.suppress(RuntimeError, TimeoutError):  # killed again while starting
                run.restart()
            continue
        try:
            jobs = Client(run.daemon.socket, 5).get("/v1/jobs").json()["jobs"]
        except Exception:
            jobs = None
        if jobs and all(j["state"] in ("succeeded", "failed") for j in jobs):
            break
        time.sleep(0.2)
    row.extra["restarts"] = restarts
    if run.alive() and jobs is not None:
        row.extra["jobs"] = [{"state": j["state"], "error": (j.get("error") or {}).get("code")} for j in jobs]
        row.note(f"{restarts} restart(s); GET /v1/jobs: {row.extra['jobs'] or 'no job'}")
        return
    from edgekit.daemon.jobs import JobStore

    stored = JobStore(run.daemon.state_dir).list(limit=100)
    row.extra["jobs"] = [{"state": j.state, "error": (j.error or {}).get("code")} for j in stored]
    row.note(
        f"{restarts} restart(s), daemon down at the end (crash loop); GET /v1/jobs unanswerable, job rows in its "
        f"database: {row.extra['jobs'] or 'none'}"
    )


def stow_during_ingest(run: Run, rounds: int = 3) -> None:
    """A normal one-instance STOW-RS, timed while a 300-slice 512x512 CT zip is ingested by POST /v1/reports."""
    made = run.bench.corpus("ct300.zip", lambda p: hc.series_zip(p, 300, 512, zeros=False))
    data = made.path.read_bytes()
    run.start_daemon()
    with run.row() as row:
        row.note(made.describe())

        def timed_stow() -> float:
            t = time.perf_counter()
            run.stow([hc.tiny_instance()], timeout=20, tag="stow")
            return time.perf_counter() - t

        idle = [timed_stow() for _ in range(3)]
        during, large = [], []
        for _ in range(rounds):  # a STOW every 0.1 s, counted when it starts while the large report runs
            t_big = time.perf_counter()
            big = threading.Thread(target=run.upload, args=("/v1/reports", [("ct300.zip", data, "application/zip")]))
            big.start()
            time.sleep(0.1)
            while big.is_alive() and run.left() > 5:
                during.append(timed_stow())
                time.sleep(0.1)
            big.join(max(1.0, run.left()))
            large.append(time.perf_counter() - t_big)
            if run.left() < 15:
                break
        row.extra.update(stow_idle_s=idle, stow_during_s=during, large_report_s=large)
        if during:
            row.note(
                f"STOW during ingest: n={len(during)} median {sorted(during)[len(during) // 2]:.2f} s max "
                f"{max(during):.2f} s (idle max {max(idle):.2f} s); the large report took "
                + "/".join(f"{t:.1f}" for t in large)
                + " s"
            )
        else:
            row.note(f"the large reports ended before a STOW could run beside them ({large} s)")


CASES: dict[str, Callable[[Run], None]] = {
    f.__name__: f
    for f in (
        jpegls_bomb,
        rle_bomb,
        jpeg2000_bomb,
        jpeg_baseline_bomb,
        deflate_bomb,
        zip_bomb,
        many_part_stow,
        slow_bodies,
        aborted_uploads,
        disk_full,
        phi_in_logs,
        poison_study,
        stow_during_ingest,
    )
}


# --- report -----------------------------------------------------------------------------------------------------
def statuses_text(statuses: dict[str, int]) -> str:
    return ",".join(f"{k}x{v}" if v > 1 else k for k, v in sorted(statuses.items())) or "-"


def print_table(rows: list[dict]) -> None:
    head = f"{'case':<36}{'statuses':<36}{'peak/idle MiB':>14}{'time s':>8}  {'ready held':<12}notes"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['name']:<36}{'skipped':<36}{'-':>14}{'-':>8}  {'-':<12}{r['skipped']}")
            continue
        ready = "yes" if r["ready_held"] else f"no ({sum(r['probe_failures'].values())}/{r['probes']})"
        print(
            f"{r['name']:<36}{statuses_text(r['statuses'])[:35]:<36}{r['peak_over_idle_mib']:>14.0f}"
            f"{r['time_s']:>8.1f}  {ready:<12}{'; '.join(r['notes'])}"
        )


def _unexpected_5xx(status: str) -> bool:
    return status[:1] == "5" and len(status) == 3 and status not in ("503", "507")


def summary(rows: list[dict]) -> dict:
    measured = [r for r in rows if "skipped" not in r]
    by_case = {r["case"]: r for r in measured}
    out = {
        "peak_over_idle_mib_max": max((r["peak_over_idle_mib"] for r in measured), default=None),
        # the house rule: bad input gets a 4xx, 503 or 507, never another 5xx
        "5xx": sum(v for r in measured for k, v in r["statuses"].items() if _unexpected_5xx(k)),
        "5xx_logged": sum(v for r in measured for k, v in r.get("logged_statuses", {}).items() if _unexpected_5xx(k)),
        "503_507": sum(v for r in measured for k, v in r["statuses"].items() if k in ("503", "507")),
    }
    if "slow_bodies" in by_case:
        out["slow_bodies_probe_failures"] = sum(by_case["slow_bodies"]["probe_failures"].values())
    if "stow_during_ingest" in by_case:
        during = by_case["stow_during_ingest"].get("stow_during_s") or []
        out["stow_during_ingest_max_s"] = max(during) if during else None
    if "phi_in_logs" in by_case:
        out["phi_hits"] = by_case["phi_in_logs"].get("phi_hits_total")
    if "poison_study" in by_case:
        out["poison"] = [
            {"row": x["label"], "restarts": x.get("restarts"), "jobs": x.get("jobs")}
            for x in measured
            if x["case"] == "poison_study"
        ]
    return out


def run_cases(names: list[str], tmp: Path, nofile: int) -> list[dict]:
    rows: list[dict] = []
    bench = Bench(tmp, nofile)
    for name in names:
        print(f"{name} ...", flush=True)
        run = Run(name, tmp / "cases", bench)
        t = time.perf_counter()
        try:
            CASES[name](run)
        except Exception as err:  # one broken case must not cost the others their numbers
            run.rows.append(
                {"case": name, "label": "", "name": name, "skipped": f"bench error: {err!r}"[:300], "statuses": {}}
            )
        finally:
            run.close()
        rows += run.rows
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        if len(names) > 1:
            print_table(run.rows)
    return rows


def measured_tree() -> Path:
    """The source tree of the edgekit the daemon runs (this checkout, or another tree on PYTHONPATH)."""
    import edgekit

    return Path(edgekit.__file__).resolve().parents[1]


def unit_nofile(tree: Path) -> int:
    """RLIMIT_NOFILE (soft) under the measured tree's systemd unit: its LimitNOFILE=, else systemd's default 1024."""
    unit = tree / "packaging" / "systemd" / "edgekitd.service"
    found = re.search(r"^LimitNOFILE=(\d+)", unit.read_text(), re.M) if unit.is_file() else None
    return int(found.group(1)) if found else 1024


def measured_source() -> dict:
    """Which tree the daemon ran and its git state."""
    root = measured_tree()
    out = {"tree": str(root)}
    git = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    if git.returncode == 0:
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "edgekit", "daemon"],
                               capture_output=True, text=True).stdout.splitlines()  # fmt: skip
        out["commit"] = git.stdout.strip()[:100]
        out["uncommitted_files_in_edgekit_daemon"] = len(dirty)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case names (see --cases)")
    ap.add_argument("--cases", action="store_true", help="list the cases and exit")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "hostile_inputs.json")
    ap.add_argument(
        "--daemon-nofile", type=int, help="the daemon's RLIMIT_NOFILE soft limit (default: its unit's; 0: inherit ours)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (corpus, daemon logs) and print its path")
    args = ap.parse_args()
    if args.cases:
        for name, fn in CASES.items():
            print(f"{name:<22}{fn.__doc__.split(chr(10))[0]}")
        return
    if args.daemon_nofile is None:
        args.daemon_nofile = unit_nofile(measured_tree())
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; --cases lists them")
    t_all = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="edgekit-hostile-"))
    try:
        if args.keep:
            print(f"working in {tmp} (kept)")
        rows = run_cases(names, tmp, args.daemon_nofile)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print_table(rows)
    result = {
        "daemon": {"model": "tiny random weights (write_tiny_model)", "threads": 1, "nofile": args.daemon_nofile},
        "source": measured_source(),
        "targets": TARGETS,
        "summary": summary(rows),
        "wall_s": time.perf_counter() - t_all,
        "rows": rows,
    }
    print("\nsummary vs targets:", json.dumps(result["summary"]), "targets:", json.dumps(TARGETS))
    if args.only and args.out.exists():  # a partial run updates its cases' rows, keeps the others
        old = json.loads(args.out.read_text())
        kept = [r for r in old.get("rows", []) if r["case"] not in names]
        result["rows"] = kept + rows
        result["summary"] = summary(result["rows"])
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({time.perf_counter() - t_all:.0f} s)")


if __name__ == "__main__":
    main()
