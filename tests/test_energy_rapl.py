"""RAPL through powercap (a laptop's fixture tree), its wrap-around, and the CVE-2020-8694 message."""

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from edgekit.energy import MeterReadError, MeterUnavailableError, RaplMeter
from edgekit.energy.counters import Unwrapper, wrapped_delta
from edgekit.energy.rapl import find_zones

from energy_trees import copy_tree, tree, write

PKG = "/sys/class/powercap/intel-rapl:0/energy_uj"
RANGE = 262143328850


def test_zones_and_the_package_total():
    zones = {z.path.name: z for z in find_zones(tree("laptop"))}
    assert set(zones) == {"intel-rapl:0", "intel-rapl:0:0", "intel-rapl:0:1", "intel-rapl:1"}
    assert zones["intel-rapl:0"].name == "package-0" and zones["intel-rapl:0"].max_range_uj == RANGE
    assert not zones["intel-rapl:0:0"].top_level
    m = RaplMeter(tree("laptop"))
    assert m.source == "measured:rapl:package-0"  # core/uncore are inside the package; psys is not added
    assert sorted(m.describe()["not_summed"]) == ["core", "psys", "uncore"]


def test_energy_and_power_from_counter_deltas(tmp_path):
    root = copy_tree("laptop", tmp_path)
    m = RaplMeter(root)
    write(root, PKG, 123456789 + 2_500_000)  # +2.5 J
    r = m.read()
    assert r.energy_j == pytest.approx(2.5)
    assert r.watts is not None and r.watts > 0
    write(root, PKG, 123456789 + 4_000_000)
    assert m.read().energy_j == pytest.approx(4.0)


def test_the_counter_wraps_at_max_energy_range_uj(tmp_path):
    root = copy_tree("laptop", tmp_path)
    write(root, PKG, RANGE - 1_000_000)  # 1 J before the wrap
    m = RaplMeter(root)
    write(root, PKG, 3_000_000)  # wrapped: 1 J + 3 J
    assert m.read().energy_j == pytest.approx(4.0)
    write(root, PKG, 5_000_000)
    assert m.read().energy_j == pytest.approx(6.0)


def test_wrapped_delta_and_resets():
    assert wrapped_delta(10, 25, 100) == 15
    assert wrapped_delta(90, 5, 100) == 15
    assert wrapped_delta(7, 7, None) == 0
    with pytest.raises(MeterReadError, match="backwards"):
        wrapped_delta(500, 20, None)  # NVML after a driver reload: no range to wrap at
    with pytest.raises(MeterReadError, match="beyond its range"):
        wrapped_delta(10, 150, 100)
    u = Unwrapper(95, 100)
    assert [u.update(x) for x in (99, 3, 50)] == [4, 8, 55]


def test_a_counter_reading_garbage_is_a_read_error(tmp_path):
    root = copy_tree("laptop", tmp_path)
    m = RaplMeter(root)
    write(root, PKG, "")
    with pytest.raises(MeterReadError, match="energy_uj"):
        m.read()


def _as_unprivileged(fn) -> str:
    """fn() as an unprivileged user: in-process when not root, else in a forked child that drops to nobody (root
    reads any file, so only a real non-root process shows the kernel's refusal)."""
    if os.geteuid() != 0:
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = fn()
        except BaseException as e:
            out = f"unexpected {type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_an_unreadable_counter_names_the_file_and_the_cve():
    root = Path(tempfile.mkdtemp(prefix="edgekit-rapl-"))
    try:
        os.chmod(root, 0o755)
        shutil.copytree(tree("laptop") / "sys", root / "sys")
        for d, _, files in os.walk(root):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(Path(d) / f, 0o444)
        energy = root / PKG.lstrip("/")
        os.chmod(energy, 0o400 if os.geteuid() == 0 else 0)  # as the kernel ships it since CVE-2020-8694

        def try_open():
            try:
                RaplMeter(root)
            except MeterUnavailableError as e:
                return str(e)
            return "opened"

        message = _as_unprivileged(try_open)
        assert message.startswith(f"{energy}: not readable by this user")
        assert "CVE-2020-8694" in message and "root" in message
        assert stat.S_IMODE(energy.stat().st_mode) in (0o400, 0)
    finally:
        for d, _, _files in os.walk(root):
            os.chmod(d, 0o755)
        shutil.rmtree(root)
