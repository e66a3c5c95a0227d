"""Ingest in worker processes: `load_study` off the caller's interpreter, so decoding holds no lock a server needs.

pydicom's pure-Python parsing and every JPEG 2000 decoder it can use (GDCM, pylibjpeg-openjpeg, Pillow) hold the
GIL while they run: in a threaded server a 256x256 J2K slice takes 11-14 ms of it, during which neither the HTTP
stack nor the token engine's step loop can run. A worker process decodes instead, and the server's threads only
wait on a pipe.

What crosses the pipe, per study: the path and the limits in; the study's cost out, answered by the caller's
`admit` (the daemon's memory pool reserves it on its side before a pixel is decoded, as in-process); then the study
without its frames, or the error. The frames never cross it: the worker decodes straight into a memfd
(`frames_allocated_by`) and hands the descriptor over (SCM_RIGHTS), so the caller maps the same pages, no copy,
and they are charged once to the service's cgroup (MemoryMax counts the workers too).

A worker that dies while decoding (a decoder's crash, the kernel's OOM killer) or outlives `timeout_s` is that
study's error (`ingest_crashed`, `ingest_timeout`), never the caller's: it is replaced, and the next study gets a
fresh one. A worker whose resident memory stays high after a large study is replaced too (glibc keeps freed
arenas). A worker is `python -m edgekit.ingest.workers FD`, exec'd (never a fork of a threaded server, and not
multiprocessing's start methods, which re-import the server's main module in every child).
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path

import numpy as np

from edgekit.errors import EdgekitError, StudyError
from edgekit.ingest.budget import Admit
from edgekit.ingest.decode_threads import child_env, decode_threads, set_threads
from edgekit.ingest.study import IngestLimits, Study, frames_allocated_by

log = logging.getLogger(__name__)

# A worker's resident memory above its size after start-up by more than this is given back by replacing it.
RETIRE_GROWTH_BYTES = 256 * 2**20
START_TIMEOUT_S = 60.0


def default_processes() -> int:
    """Half the physical cores, 2 to 4: the rest run the model and its caller. At least two, so a study's decode
    need not wait for the one before it: on 2 cores, with one process, edgekitd's reports at concurrency 8 queued
    for it; two served 1.19x its req/s at 0.71x its p95 (bench/daemon_load.py, one run)."""
    from edgekit.ort.threads import physical_cores  # not at the top: a worker process never needs ONNX Runtime

    return max(2, min(4, physical_cores() // 2))


class IngestCrashedError(StudyError):
    """The process decoding a study died: the study's fault (a decoder's crash on its bytes) until shown otherwise."""

    code = "ingest_crashed"
    http_status = 422


class IngestTimeoutError(StudyError):
    code = "ingest_timeout"
    http_status = 422


class IngestWorkers:
    """Up to `processes` worker processes, started on first use or together by `warm`; `load` is blocking and
    thread-safe (a caller waits for an idle worker)."""

    def __init__(self, processes: int, timeout_s: float = 300.0):
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self.processes, self.timeout_s = processes, timeout_s
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()  # None: a free slot
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._started = self._busy = 0
        self._closed = False

    def load(self, path: str | os.PathLike, limits: IngestLimits, admit: Admit | None = None) -> Study:
        """`load_study(path, limits=limits, admit=admit)` in a worker; `admit` runs here, in the caller.

        The worker decodes JPEG 2000 with the CPUs shared among the studies decoding when it starts
        (`decode_threads.py`). The study says how long it waited for a busy worker (`ingest_wait_ms`); starting one
        for it (the first study, a replacement) is not counted."""
        t0 = time.perf_counter()
        worker = self._take()
        taken = time.perf_counter()
        # the part of the wait that the worker it got spent starting (for this study, or ahead of it) is no busy one's
        starting = max(0.0, min(taken, worker.ready_at) - max(t0, worker.started_at))
        waited_ms = max(0.0, taken - t0 - starting) * 1e3
        try:
            with self._lock:
                self._busy += 1
                threads = decode_threads(self._busy)
            try:
                study = worker.load(Path(path), limits, admit, self.timeout_s, threads)
                study.ingest_wait_ms = waited_ms
                return study
            finally:
                with self._lock:
                    self._busy -= 1
        finally:
            self._give_back(worker)

    def warm(self) -> None:
        """Start the workers not started yet, side by side, and return once they are up: for a server's start-up
        (beside loading its model), so that its first studies do not each wait for a process to start. One that
        fails to start is logged and its slot left free: the study that takes it starts one, or gets the error."""
        with self._lock:
            missing = 0 if self._closed else self.processes - self._started
            self._started += missing
        starting = [threading.Thread(target=self._start_idle, name="edgekit-ingest-start") for _ in range(missing)]
        for t in starting:
            t.start()
        for t in starting:
            t.join()

    def _start_idle(self) -> None:
        try:
            worker = _Worker.start()
        except Exception as err:
            log.warning("an ingest worker did not start: %s", err)
            self._idle.put(None)
            return
        if self._adopt(worker):
            self._idle.put(worker)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        with self._lock:
            return [w.proc.pid for w in self._all if w.proc.poll() is None]

    def close(self) -> None:
        """Stop every worker; a study being decoded fails as crashed, a caller waiting for a worker is woken."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for w in workers:
            w.stop()
        for _ in range(self.processes):
            self._idle.put(None)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the ingest workers are closed")
            new = self._idle.empty() and self._started < self.processes
            self._started += new
        if not new:
            worker = self._idle.get()
            if self._closed:
                raise RuntimeError("the ingest workers are closed")
            if worker is not None and worker.proc.poll() is None:
                return worker
            if worker is not None:  # died idle (the OOM killer's pick): not this study's doing, so a fresh one
                log.warning("ingest worker %s died while idle (status %s)", worker.proc.pid, worker.proc.returncode)
                self._forget(worker)
        try:
            worker = _Worker.start()
        except BaseException:
            if new:
                with self._lock:
                    self._started -= 1
            else:
                self._idle.put(None)  # the slot stays free for the next caller
            raise
        if not self._adopt(worker):
            raise RuntimeError("the ingest workers are closed")
        return worker

    def _adopt(self, worker: _Worker) -> bool:
        """Count a worker just started in, unless the pool closed meanwhile: then it is stopped (close() could not)."""
        with self._lock:
            if not self._closed:
                self._all.append(worker)
                return True
        worker.stop()
        return False

    def _give_back(self, worker: _Worker) -> None:
        """Back to the idle ones when its last exchange ended cleanly and it is still fit, else replaced (later,
        by whoever takes its slot)."""
        if worker.in_sync and worker.fit():
            self._idle.put(worker)
            return
        self._forget(worker)
        self._idle.put(None)

    def _forget(self, worker: _Worker) -> None:
        worker.stop()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)


class _Worker:
    """One worker process and the parent's end of its socket."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, baseline_rss: int):
        self.proc, self.conn, self.baseline_rss = proc, conn, baseline_rss
        self.in_sync = True  # the last exchange ended where both sides expect the next path
        self.started_at = self.ready_at = 0.0  # perf_counter when it was started and when it said it was ready

    @property
    def start_s(self) -> float:
        """Seconds it took to start."""
        return self.ready_at - self.started_at

    @classmethod
    def start(cls) -> _Worker:
        t0 = time.perf_counter()
        ours, theirs = socket.socketpair()
        with ours, theirs:
            # this process's imports; one BLAS thread (ingest does no linear algebra worth a pool of them)
            env = child_env({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **os.environ})
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            proc = subprocess.Popen(
                [sys.executable, "-m", "edgekit.ingest.workers", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
            )
            conn = Connection(ours.detach())
        worker = cls(proc, conn, 0)
        if not conn.poll(START_TIMEOUT_S):
            worker.stop()
            raise RuntimeError(f"an ingest worker did not start within {START_TIMEOUT_S:.0f} s")
        try:
            worker.baseline_rss = int(conn.recv()[1])
        except (EOFError, ConnectionError):
            worker.stop()
            raise RuntimeError(f"an ingest worker exited at start (status {proc.returncode})") from None
        worker.started_at, worker.ready_at = t0, time.perf_counter()
        return worker

    def load(self, path: Path, limits: IngestLimits, admit: Admit | None, timeout_s: float, threads: int) -> Study:
        deadline = time.monotonic() + timeout_s
        refused: BaseException | None = None
        self.in_sync = False
        try:
            self.conn.send((str(path), limits, threads))
            while True:
                if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                    self.proc.kill()
                    raise IngestTimeoutError(f"decoding took longer than {timeout_s:.0f} s; refused", path)
                kind, *body = self.conn.recv()
                if kind == "cost":
                    try:
                        if admit is not None:
                            admit(body[0])
                    except BaseException as err:
                        refused = err
                        self.conn.send(False)
                    else:
                        self.conn.send(True)
                    continue
                if kind == "done":
                    study, shape = body
                    fd = recv_handle(self.conn)
                self.in_sync = True
                if kind == "refused":
                    raise refused if refused is not None else RuntimeError("ingest worker: refused unasked")
                if kind == "error":
                    raise body[0]
                if kind == "bug":
                    raise RuntimeError(f"ingest worker: {body[0]}")
                study.frames = _map_frames(fd, shape)
                return study
        except (EOFError, ConnectionError):
            raise self._died(path) from None

    def _died(self, path: Path) -> IngestCrashedError:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit status {code}"
            if code is not None
            else "its pipe closed"
        )
        log.warning("ingest worker %s died while decoding (%s)", self.proc.pid, how)
        return IngestCrashedError(f"decoding crashed the ingest process ({how})", path)

    def fit(self) -> bool:
        """Still worth keeping: alive, and not holding far more memory than when it started."""
        return self.proc.poll() is None and _rss(self.proc.pid) - self.baseline_rss < RETIRE_GROWTH_BYTES

    def stop(self) -> None:
        try:
            self.conn.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                log.warning("ingest worker %s did not exit after SIGKILL", self.proc.pid)


def _map_frames(fd: int, shape: tuple[int, ...]) -> np.ndarray:
    try:
        count = int(np.prod(shape))
        if count == 0:
            return np.empty(shape, dtype=np.float32)
        mapped = mmap.mmap(fd, count * 4)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.float32, count=count).reshape(shape)


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


# --- the worker's side ---


class _Refused(Exception):
    """The caller's `admit` refused the study's cost; the caller raises its own error."""


class _MemfdFrames:
    """The worker's frames allocator: each array lives in its own memfd, which the worker hands to the caller."""

    def __init__(self) -> None:
        self.maps: list[tuple[int, mmap.mmap, np.ndarray]] = []

    def __call__(self, shape: tuple[int, ...]) -> np.ndarray:
        size = max(1, int(np.prod(shape))) * 4
        fd = os.memfd_create("edgekit-frames", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
        array = np.frombuffer(mapped, dtype=np.float32, count=int(np.prod(shape))).reshape(shape)
        self.maps.append((fd, mapped, array))
        return array

    def export(self, frames: np.ndarray) -> int:
        """A descriptor whose first bytes are `frames` (C order): the memfd they were decoded into when they are its
        leading prefix (a series with skipped slices keeps `out[:n]`), else a new one they are copied into."""
        for fd, _, array in self.maps:
            if frames.flags.c_contiguous and frames.size and _same_start(frames, array):
                return os.dup(fd)
        copy = self((*frames.shape,))
        copy[...] = frames
        return os.dup(self.maps[-1][0])

    def close(self) -> None:
        for fd, mapped, _ in self.maps:
            os.close(fd)
            try:
                mapped.close()
            except BufferError:  # an array still refers to it; the mapping goes with the array
                pass
        self.maps.clear()


def _same_start(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def _serve(conn: Connection) -> None:
    """A worker's life: load each study asked for until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the daemon's terminal is the daemon's to handle
    _log_to_stderr_scrubbed()
    from PIL import Image

    from edgekit.ingest.load import load_study

    Image.init()  # Pillow imports its ~60 format plugins at its first JPEG 2000 open: here, not on a study's time
    conn.send(("ready", _rss(os.getpid())))
    while True:
        try:
            path, limits, *hint = conn.recv()  # a daemon older than this file (mid-upgrade) sends no thread hint
        except (EOFError, OSError):
            return
        if hint:
            set_threads(hint[0])  # this process has no other thread that decodes or reads the environment
        frames = _MemfdFrames()
        try:
            _load_one(conn, load_study, path, limits, frames)
        finally:
            frames.close()


def _load_one(conn: Connection, load_study, path: str, limits: IngestLimits, frames: _MemfdFrames) -> None:  # noqa: ANN001 - the loader, imported once
    def admit(cost: int) -> None:
        conn.send(("cost", cost))
        if not conn.recv():
            raise _Refused

    try:
        with frames_allocated_by(frames):
            study = load_study(path, limits=limits, admit=admit)
    except _Refused:
        conn.send(("refused",))
        return
    except EdgekitError as err:
        conn.send(("error", _portable(err)))
        return
    except Exception as err:  # a bug: its type and scrubbed text, never a path or a header value verbatim
        from edgekit.ingest.phi import scrub

        log.error("ingest worker: %s", scrub("".join(traceback.format_exception(err))))
        conn.send(("bug", scrub(f"{type(err).__name__}: {err}")))
        return
    fd = frames.export(study.frames)
    shape = study.frames.shape
    bare = replace(study, frames=np.empty((0,), dtype=np.float32))
    del study
    try:
        conn.send(("done", bare, shape))
        send_handle(conn, fd, 0)  # the pid is Windows' (DuplicateHandle); on Linux it is SCM_RIGHTS
    finally:
        os.close(fd)


def _portable(err: EdgekitError) -> EdgekitError:
    """The error itself when it survives pickling (its class, reason, path and code do), else a StudyError with
    the same reason, path and code."""
    import pickle

    try:
        pickle.dumps(err)
        return err
    except Exception:
        return StudyError(err.reason, err.path, code=err.code)


def _log_to_stderr_scrubbed() -> None:
    """The daemon's stderr is the journal: the worker's records go there with the daemon's scrubbing, never
    through logging's last-resort handler unscrubbed."""
    from edgekit.ingest.phi import install_handlers

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("edgekitd-ingest[%(process)d] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    install_handlers([handler])


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
