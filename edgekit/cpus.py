"""How many CPUs this process may keep busy: its affinity (a cpuset) capped by its cgroup's CPU quota.

A CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`; set by systemd's CPUQuota=, `docker run --cpus`, a
Kubernetes CPU limit such as our Helm chart's) leaves the affinity as it was: a 2-CPU limit on a 12-core Orin still
shows 12 CPUs. Threads sized from the affinity then run past the quota, and ONNX Runtime's pool threads, which spin
while they wait, are throttled for the rest of each period (radreport-tiny's report 3.3x slower under a 1-CPU quota
on a 2-CPU host: `bench/cpu_quota.py`). Every thread count edgekit chooses starts here; a count the user sets is kept.

The quota is rounded down (at least 1): a thread beyond a whole CPU of quota spins into the throttle too (1.5 CPUs:
two ONNX Runtime threads 44-49 ms a report against one thread's 25-27 ms). Free of numpy and onnxruntime: the CLI
and the ingest processes read it before either is imported.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may run on (`affinity`), its cgroup's quota in CPUs (None: no quota), and the two
    together (`usable`)."""

    affinity: int
    quota: float | None

    @property
    def usable(self) -> int:
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.floor(self.quota + 1e-9)))

    def describe(self) -> str:
        """For a start-up log line: where the count came from."""
        cpus = f"{self.usable} CPU{'' if self.usable == 1 else 's'}"
        if self.quota is None or self.quota >= self.affinity:
            return f"{cpus} (affinity)"
        return f"{cpus} (affinity {self.affinity}, cgroup CPU quota {self.quota:g})"


def cpu_budget(root: Path = Path("/")) -> CpuBudget:
    """This process's CPUs as `root`'s /proc and cgroup file systems describe them (`root`: a test's fixture tree
    with the real layout; the affinity is always this process's)."""
    return CpuBudget(_affinity(), cpu_quota(root))


_REREAD_S = 5.0  # a cpuset or quota changed while the process runs is followed within this (Go re-reads every 1 s)
_last: tuple[float, int] | None = None  # (when read, usable)


def usable_cpus() -> int:
    """CPUs this process may keep busy. Reading them costs about 0.1 ms, so a value is kept for a few seconds: what
    is sized per study follows a changed cpuset or quota; ONNX Runtime's threads are sized once, at a session's
    start."""
    global _last
    now = time.monotonic()
    if _last is None or now - _last[0] > _REREAD_S:
        _last = (now, cpu_budget().usable)
    return _last[1]


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota on this process's cgroup and its ancestors, in CPUs, over every cgroup hierarchy that
    has the cpu controller (v2, and v1 on a hybrid host); None when there is none or nothing can be read."""
    try:
        cgroups = (root / "proc/self/cgroup").read_text()
        mounts = (root / "proc/self/mountinfo").read_text()
    except OSError:
        return None
    paths = _cgroup_paths(cgroups)
    found = [
        q
        for version, mount_root, mount_point in cgroup_mounts(mounts)
        if (path := paths.get(version)) is not None
        and (relative := _relative(path, mount_root)) is not None
        and (q := _tightest(root / mount_point.lstrip("/"), relative, version)) is not None
    ]
    return min(found, default=None)


def _cgroup_paths(text: str) -> dict[str, str]:
    """{"v2": path, "v1": path of the hierarchy with the cpu controller} from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            out["v2"] = path
        elif "cpu" in controllers.split(","):
            out["v1"] = path
    return out


def cgroup_mounts(text: str) -> list[tuple[str, str, str]]:
    """(version, root, mount point) of each cgroup2 mount and each v1 mount of the cpu controller (mountinfo)."""
    out = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        fstype, options = rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            out.append(("v2", _unescape(fields[3]), _unescape(fields[4])))
        elif fstype == "cgroup" and "cpu" in options:
            out.append(("v1", _unescape(fields[3]), _unescape(fields[4])))
    return out


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _relative(path: str, mount_root: str) -> str | None:
    """The process's cgroup below the mount: a container's mount root is its own cgroup (without a cgroup
    namespace /proc/self/cgroup still names it from the host's root). None where the process's cgroup is not under
    the mount (another cgroup's bind mount, or a path that leaves a cgroup namespace: `/../x`): its quotas are not
    this process's."""
    if ".." in path.split("/"):
        return None
    if mount_root == "/":
        return path
    if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root.rstrip("/")) :] or "/"
    return None


def _tightest(mount: Path, relative: str, version: str) -> float | None:
    """The smallest quota from the cgroup's folder up to the mount's (a parent's quota bounds its children)."""
    quotas = []
    folder = mount / relative.strip("/") if relative.strip("/") else mount
    while True:
        q = _quota_v2(folder) if version == "v2" else _quota_v1(folder)
        if q is not None:
            quotas.append(q)
        if folder == mount or mount not in folder.parents:
            break
        folder = folder.parent
    return min(quotas, default=None)


def _quota_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
        if quota == "max":
            return None
        q, p = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
