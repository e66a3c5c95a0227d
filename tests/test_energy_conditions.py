"""Batteries, thermal zones and the Jetson power mode, read from fixture trees; the policy's signals in one read."""

import pytest

from edgekit.energy import battery_state, power_mode, read_conditions, read_supplies, read_zones
from edgekit.energy.nvpmodel import parse_conf, parse_query
from edgekit.energy.thermal import headroom_c

from energy_trees import copy_tree, tree, write


def test_a_laptop_on_battery_and_the_mouse_battery_left_out():
    supplies = {s.name: s for s in read_supplies(tree("laptop"))}
    assert supplies["AC"].type == "Mains" and supplies["AC"].online is False
    assert supplies["hidpp_battery_0"].scope == "Device" and not supplies["hidpp_battery_0"].is_system_battery
    b = battery_state(tree("laptop"))
    assert b.batteries == ("BAT0",)  # the mouse's 90 % says nothing about this machine
    assert b.percent == pytest.approx(100 * 32490000 / 57000000)  # energy_now / energy_full
    assert b.on_battery is True


def test_plugged_in_and_charging_is_not_on_battery(tmp_path):
    root = copy_tree("laptop", tmp_path)
    write(root, "/sys/class/power_supply/AC/online", 1)
    write(root, "/sys/class/power_supply/BAT0/status", "Charging")
    assert battery_state(root).on_battery is False
    write(root, "/sys/class/power_supply/BAT0/status", "Not charging")
    write(root, "/sys/class/power_supply/AC/online", 0)  # unplugged, the battery not yet discharging
    assert battery_state(root).on_battery is True


def test_capacity_is_used_where_energy_is_not_given(tmp_path):
    root = copy_tree("laptop", tmp_path)
    (root / "sys/class/power_supply/BAT0/energy_now").unlink()
    write(root, "/sys/class/power_supply/BAT0/capacity", 41)
    assert battery_state(root).percent == 41


def test_a_jetson_has_no_battery():
    b = battery_state(tree("agx_orin"))
    assert b.percent is None and b.on_battery is False


def test_thermal_zones_temperatures_and_trip_points():
    zones = {z.type: z for z in read_zones(tree("agx_orin"))}
    assert zones["cpu-thermal"].temp_c == pytest.approx(48.156)
    assert zones["gpu-thermal"].temp_c is None  # -256 C: the GPU's sensor is powered down
    tj = zones["tj-thermal"]
    assert [t.type for t in tj.trips] == ["active", "active", "passive", "critical"]
    assert tj.limit_c() == 95.5  # fan steps (active) are not limits
    assert tj.headroom_c() == pytest.approx(95.5 - 48.156)
    room, zone = headroom_c(list(zones.values()))
    assert zone.type == "tj-thermal" and room == pytest.approx(47.344)


def test_disabled_trip_points_are_ignored():
    zones = {z.type: z for z in read_zones(tree("laptop"))}
    assert zones["x86_pkg_temp"].limit_c() is None  # its two trips read 0: disabled
    assert headroom_c(list(zones.values()))[1].type == "TCPU"


def test_a_zone_past_its_trip_point_has_negative_headroom(tmp_path):
    root = copy_tree("orin_nano", tmp_path)
    write(root, "/sys/class/thermal/thermal_zone0/temp", 101500)
    c = read_conditions(root)
    assert c.thermal_headroom_c == pytest.approx(-2.5) and c.hottest_zone == "cpu-thermal"
    assert c.battery_pct is None and c.power_w is None


NVPMODEL_Q = "NVPM WARN: fan mode is not set!\nNV Power Mode: MODE_30W\n2\n"


def test_nvpmodel_query_output_and_conf():
    assert parse_query(NVPMODEL_Q) == parse_query("NV Power Mode: MODE_30W\n2")
    mode = parse_query(NVPMODEL_Q)
    assert (mode.id, mode.name, mode.source) == (2, "MODE_30W", "nvpmodel -q")
    modes, default = parse_conf((tree("agx_orin") / "etc/nvpmodel.conf").read_text())
    assert modes == {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"} and default == 2


def test_the_power_mode_from_the_status_file_or_the_default():
    agx = power_mode(tree("agx_orin"))
    assert (agx.id, agx.name) == (3, "MODE_50W") and "status" in agx.source
    nano = power_mode(tree("orin_nano"))  # never switched: no status file, the conf's default
    assert (nano.id, nano.name) == (0, "15W") and "default" in nano.source
    assert power_mode(tree("laptop")) is None
