"""The CPUs edgekit sizes its threads from: the affinity capped by the cgroup's CPU quota, read from /proc and the
cgroup file systems in the layouts systemd, Docker and Kubernetes leave (fixture trees), and from a real cgroup with
a quota where this machine lets the test make one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgekit.cpus import CpuBudget, cpu_quota
from edgekit.daemon.testing import DaemonProcess, QuotaCgroup, write_tiny_model

SAMPLE = Path(__file__).resolve().parents[1] / "models" / "samples" / "cr_chest" / "image.dcm"
V2_MOUNT = "30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
ROOT_FS = "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"


def tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(ROOT_FS + mountinfo)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_container_limit_on_cgroup_v2_is_read(tmp_path: Path) -> None:
    """`docker run --cpus 2` / a Kubernetes limit of 2 with a cgroup namespace: the container's cgroup is the
    mount's root."""
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "200000 100000\n"})
    assert cpu_quota(root) == 2.0


def test_the_tightest_quota_up_a_systemd_unit_s_slices_wins(tmp_path: Path) -> None:
    """CPUQuota= on the slice bounds the service below it, whose own cpu.max is unlimited."""
    root = tree(
        tmp_path,
        "0::/system.slice/edgekitd.service\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/system.slice/edgekitd.service/cpu.max": "max 100000\n",
            "sys/fs/cgroup/system.slice/cpu.max": "150000 100000\n",
            "sys/fs/cgroup/cpu.max": "400000 100000\n",
        },
    )
    assert cpu_quota(root) == 1.5


def test_no_quota_is_none(tmp_path: Path) -> None:
    root = tree(tmp_path, "0::/user.slice\n", V2_MOUNT, {"sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"})
    assert cpu_quota(root) is None
    assert cpu_quota(tmp_path / "nowhere") is None  # no /proc at all: no quota, not an error


def test_cgroup_v1_without_a_namespace_maps_the_host_path_onto_the_mount(tmp_path: Path) -> None:
    """Docker on cgroup v1: /proc/self/cgroup names the container's cgroup from the host's root, and the mount's
    root is that same cgroup; its quota sits at the mount point."""
    mount = (
        "35 30 0:31 /docker/0123abcd /sys/fs/cgroup/cpu,cpuacct ro,nosuid,nodev,noexec,relatime master:12 "
        "- cgroup cgroup rw,cpu,cpuacct\n"
    )
    root = tree(
        tmp_path,
        "12:cpu,cpuacct:/docker/0123abcd\n11:memory:/docker/0123abcd\n",
        mount,
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_quota(root) == 0.5


def test_cgroup_v1_unlimited_is_none_and_a_hybrid_host_reads_the_v1_cpu_controller(tmp_path: Path) -> None:
    """A hybrid host (this CI's kind): controllers on v1, an empty cgroup2 at /sys/fs/cgroup/unified."""
    mounts = (
        "40 30 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "41 30 0:34 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    files = {
        "sys/fs/cgroup/cpu/edgekit/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu/edgekit/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
    }
    unlimited = tree(tmp_path / "a", "1:cpu:/edgekit\n0::/\n", mounts, files)
    assert cpu_quota(unlimited) is None
    files["sys/fs/cgroup/cpu/edgekit/cpu.cfs_quota_us"] = "300000\n"
    assert cpu_quota(tree(tmp_path / "b", "1:cpu:/edgekit\n0::/\n", mounts, files)) == 3.0


def test_escaped_mount_points_and_unreadable_files(tmp_path: Path) -> None:
    mount = "30 24 0:26 / /run/cgroup\\040v2 rw - cgroup2 cgroup2 rw\n"
    root = tree(tmp_path, "0::/a\n", mount, {"run/cgroup v2/a/cpu.max": "100000 100000\n"})
    assert cpu_quota(root) == 1.0
    (root / "run/cgroup v2/a/cpu.max").write_text("garbage\n")
    assert cpu_quota(root) is None


def test_a_mount_of_another_cgroup_is_not_this_process_s(tmp_path: Path) -> None:
    """A bind mount of some other cgroup (its root not above this process's), and a path that leaves a cgroup
    namespace (`/../x`), hold quotas that are not this process's: ignored, not read from the mount's folder."""
    mounts = (
        "35 30 0:31 /docker/abc /mnt/other rw - cgroup2 cgroup2 rw\n"
        "36 30 0:31 /docker/abcdef /mnt/prefix rw - cgroup2 cgroup2 rw\n"
    )
    files = {"mnt/other/cpu.max": "50000 100000\n", "mnt/prefix/cpu.max": "50000 100000\n"}
    assert cpu_quota(tree(tmp_path / "a", "0::/docker/abcd\n", mounts, files)) is None
    outside = tree(tmp_path / "b", "0::/../sibling\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "50000 100000\n"})
    assert cpu_quota(outside) is None


@pytest.mark.parametrize(
    ("affinity", "quota", "usable"),
    [(2, None, 2), (12, 2.0, 2), (12, 1.5, 1), (2, 0.5, 1), (2, 4.0, 2), (12, 2.99, 2)],
)
def test_the_usable_count_is_the_affinity_within_the_quota_rounded_down(
    affinity: int, quota: float | None, usable: int
) -> None:
    assert CpuBudget(affinity, quota).usable == usable


def test_the_start_up_line_says_where_the_count_came_from() -> None:
    assert CpuBudget(12, 2.0).describe() == "2 CPUs (affinity 12, cgroup CPU quota 2)"
    assert CpuBudget(2, 1.5).describe() == "1 CPU (affinity 2, cgroup CPU quota 1.5)"
    assert CpuBudget(2, None).describe() == "2 CPUs (affinity)"
    assert CpuBudget(2, 8.0).describe() == "2 CPUs (affinity)"


def test_a_process_in_a_real_one_cpu_quota_sizes_every_thread_pool_to_it() -> None:
    """A real cgroup with a 1-CPU quota (needs root and a writable cgroup file system with the cpu controller): the
    child's ONNX Runtime threads, its JPEG 2000 decode threads and its energy estimate's vCPUs are all one; a count
    the user set is kept."""
    hierarchy = QuotaCgroup.find()
    if hierarchy is None:
        pytest.skip("needs a writable cgroup hierarchy with the cpu controller (root, not a read-only /sys/fs/cgroup)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 CPUs in this process's affinity for a 1-CPU quota to change anything")
    with QuotaCgroup(hierarchy, cpus=1.0) as group:
        probe = textwrap.dedent(
            """
            import json
            from edgekit.cpus import cpu_budget, usable_cpus
            from edgekit.energy.cpu_estimate import CpuTimeMeter
            from edgekit.ingest.decode_threads import decode_threads
            from edgekit.ort import physical_cores, session_options
            print(json.dumps({
                "usable": usable_cpus(), "quota": cpu_budget().quota, "ort": physical_cores(),
                "session": session_options().intra_op_num_threads,
                "explicit": session_options(intra_op_threads=2).intra_op_num_threads,
                "decode": decode_threads(), "vcpus": CpuTimeMeter().vcpus,
            }))
            """
        )
        out = subprocess.run(
            group.wrap([sys.executable, "-c", probe]),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got.pop("quota") <= 1.0  # less only where a quota above the test's cgroup is smaller still
        assert got == {
            "usable": 1,
            "ort": 1,
            "session": 1,
            "explicit": 2,
            "decode": 1,
            "vcpus": 1,
        }


def test_edgekitd_in_a_real_one_cpu_quota_sizes_its_threads_to_it_and_says_so(tmp_path: Path) -> None:
    """The daemon started as a unit with CPUQuota=100% or a pod with a 1-CPU limit would be (needs root and a
    writable cgroup file system with the cpu controller): its start-up line names the quota, and its ONNX Runtime
    threads are one (on 4 cores or more the affinity alone would give it two or more)."""
    hierarchy = QuotaCgroup.find()
    if hierarchy is None:
        pytest.skip("needs a writable cgroup hierarchy with the cpu controller (root, not a read-only /sys/fs/cgroup)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 CPUs in this process's affinity for a 1-CPU quota to change anything")
    d = DaemonProcess(tmp_path / "state", write_tiny_model(tmp_path / "model"), threads=None)  # its own choice
    with QuotaCgroup(hierarchy, cpus=1.0) as group, d.start(args=group.wrap(d.args), wait_ready=120):
        assert d.client.report(SAMPLE).status == 200
        affinity = len(os.sched_getaffinity(0))
        assert d.cpu_plan().startswith(
            f"1 CPU (affinity {affinity}, cgroup CPU quota 1); ONNX Runtime threads per variant: 1,"
        )
