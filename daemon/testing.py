"""Helpers for tests and the bench: a tiny random-weights model directory and a daemon in a subprocess.

Until the trained radreport-tiny weights are committed (and to keep tests fast after), tests serve a small model
with random weights; the daemon builds it into a bundle the same way it builds the embedded default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from edgekit.ingest.decode_threads import child_env

from .client import Client

TINY = dict(
    image_size=32,
    patch_size=8,
    num_frames=2,
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
    hidden=48,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=96,
    max_positions=128,
)


def process_tree(pid: int) -> list[int]:
    """The daemon and its descendants (its ingest worker processes): all in the service's cgroup, all under its
    MemoryMax, so all counted here."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def proc_kib_one(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid` alone in KiB ({} once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM") if k in fields}


def proc_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in KiB of `pid` and its descendants, summed ({} once `pid` is gone). Pages a worker shares
    with the daemon (a study's frames, handed over in a memfd) count in both: an upper bound."""
    total: dict[str, int] = {}
    for p in process_tree(pid):
        one = proc_kib_one(p)
        if not one and p == pid:
            return {}
        for k, v in one.items():
            total[k] = total.get(k, 0) + v
    return total


def write_tiny_model(
    out: Path, *, seed: int = 0, max_new_tokens: int = 24, full_size: bool = False, num_frames: int | None = None
) -> Path:
    """A model directory `edgekit.build.build` accepts: random weights, a real tokenizer, the three configs.
    `full_size`: radreport-tiny's real architecture (for timing), else a much smaller one (for fast tests);
    `num_frames`: the frames per study the model takes (frame-skipping tests want more than the tiny one's 2)."""
    from safetensors.numpy import save_file

    from edgekit.export import random_weights
    from edgekit.export.model_config import ModelConfig
    from edgekit.models.radreport_tiny.tokenizer import BOS_ID, EOS_ID, PAD_ID, PROMPT_TEMPLATE, SEP_ID, train_tokenizer
    from edgekit.models.synth import generate_study
    from edgekit.preprocess import PreprocessConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    texts = [r for i in range(12) for r in generate_study(i, "train").references]
    tok = train_tokenizer(texts + ["CT: Follow-up.", "DX: Cough."], vocab_size=256)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), **({} if full_size else TINY))
    if num_frames is not None:
        cfg = dataclasses.replace(cfg, num_frames=num_frames)
    save_file(random_weights(cfg, seed), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    tok.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "prompt_template": PROMPT_TEMPLATE,
                "bos_token_id": BOS_ID,
                "eos_token_id": EOS_ID,
                "sep_token_id": SEP_ID,
                "pad_token_id": PAD_ID,
                "max_new_tokens": max_new_tokens,
            }
        )
    )
    PreprocessConfig(image_size=cfg.image_size, num_frames=cfg.num_frames).save(out / "preprocessor_config.json")
    return out


class DaemonProcess:
    """`python -m edgekit.daemon` with a private state dir and socket; `stop()` sends SIGTERM, `kill()` SIGKILL."""

    def __init__(
        self,
        state_dir: Path,
        model_dir: Path | None = None,
        *,
        config: Path | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        socket_path: Path | None = None,
        threads: int | None = 1,
    ):
        """`threads`: ONNX Runtime's threads (1 keeps tests light; None: the daemon's own default)."""
        self.state_dir = Path(state_dir)
        self.socket = Path(socket_path) if socket_path else self.state_dir / "edgekitd.sock"
        self.args = [
            sys.executable,
            "-m",
            "edgekit.daemon",
            "--state-dir",
            str(self.state_dir),
            "--socket",
            str(self.socket),
            *(["--threads", str(threads)] if threads is not None else []),
        ]
        if model_dir is not None:
            self.args += ["--default-model-dir", str(model_dir)]
        if config is not None:
            self.args += ["--config", str(config)]
        self.args += list(extra_args)
        self.env = {**child_env(dict(os.environ)), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.client = Client(self.socket, timeout=60)
        self.log = self.state_dir / "daemon.log"

    def start(self, *, wait_ready: float | None = 90.0, **popen) -> DaemonProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            popen.pop("args", self.args), env=self.env, stdout=self._logf, stderr=subprocess.STDOUT, **popen
        )
        if wait_ready:
            self.wait_ready(wait_ready)
        return self

    def cpu_plan(self) -> str:
        """What the daemon's start-up line says it sized its threads from ("" before it says it)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return next((x.split("CPUs: ", 1)[1] for x in lines if "CPUs: " in x), "")

    def wait_ready(self, timeout: float = 90.0) -> None:
        proc = self.proc
        if proc is None:
            raise RuntimeError("edgekitd is not started (start() first)")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"edgekitd exited with {proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if self.client.get("/v2/health/ready", timeout=5).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"edgekitd not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._logf.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
            self._logf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.stop(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def tiny_daemon(root: Path, config: str = "") -> Iterator[DaemonProcess]:
    """A running daemon under `root` serving a tiny random-weights model, configured by `config` (TOML text, kept
    in `root/edgekitd.toml`, which a test may rewrite and SIGHUP): the tests' usual module fixture."""
    root = Path(root)
    path = root / "edgekitd.toml"
    path.write_text(config)
    with DaemonProcess(root / "state", write_tiny_model(root / "model"), config=path).start() as d:
        yield d


class QuotaCgroup:
    """A cgroup with a CPU quota for a test or the bench to start processes in (`wrap`), as systemd's CPUQuota=,
    `docker run --cpus` or a Kubernetes CPU limit leave one: cgroup v1's cpu controller or a v2 hierarchy that
    delegates cpu. `find()` is None where this machine lets no one make one (not root, a read-only cgroup fs)."""

    def __init__(self, hierarchy: Path, cpus: float, period_us: int = 100_000):
        self.path = hierarchy / f"edgekit-quota-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.path.mkdir()
        self.v2 = (self.path / "cpu.max").exists()
        try:
            self.set(cpus, period_us)
        except BaseException:
            self.path.rmdir()
            raise

    @staticmethod
    def find() -> Path | None:
        from edgekit.cpus import cgroup_mounts

        try:
            mounts = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
        except OSError:
            return None
        for version, root, mount_point in mounts:
            mount = Path(mount_point)
            try:
                delegates_cpu = version == "v1" or "cpu" in (mount / "cgroup.subtree_control").read_text().split()
            except OSError:
                delegates_cpu = False
            if root == "/" and delegates_cpu and os.access(mount, os.W_OK):
                return mount
        return None

    def set(self, cpus: float, period_us: int = 100_000) -> None:
        quota = int(cpus * period_us)
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota} {period_us}\n")
        else:
            (self.path / "cpu.cfs_period_us").write_text(f"{period_us}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def wrap(self, args: Sequence[str]) -> list[str]:
        """`args` started inside this cgroup (the shell joins it, then execs them): its children are in it too."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *args]

    def throttled(self) -> tuple[int, float]:
        """(periods throttled, seconds throttled) so far."""
        return cgroup_throttled(self.path)

    def close(self) -> None:
        """Removed once its processes are gone (the kernel refuses a cgroup with members); any still in it after
        5 s (a killed daemon's ingest processes) are killed first."""
        for attempt in range(60):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if attempt == 50:
                    for pid in (self.path / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.1)
        raise RuntimeError(f"cgroup {self.path} could not be removed: its processes did not end")

    def __enter__(self) -> QuotaCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cgroup_throttled(cgroup: Path) -> tuple[int, float]:
    """(periods throttled, seconds throttled) of a cgroup so far, from its cpu.stat (v2 or v1)."""
    stat = dict(line.split() for line in (Path(cgroup) / "cpu.stat").read_text().splitlines() if line.strip())
    if "throttled_usec" in stat:
        return int(stat["nr_throttled"]), int(stat["throttled_usec"]) / 1e6
    return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e9
