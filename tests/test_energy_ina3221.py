"""The INA3221 reader against fixture trees laid out as on AGX Orin, Orin Nano and a JetPack 4 TX2 (ina3221x)."""

import pytest

from edgekit.energy import Ina3221Meter, MeterReadError, MeterUnavailableError
from edgekit.energy.ina3221 import find_channels
from edgekit.energy.rails import board_total, total_rails

from energy_trees import copy_tree, tree, write


def test_agx_orin_total_is_the_sum_of_its_three_module_rails():
    m = Ina3221Meter(tree("agx_orin"))
    r = m.read()
    assert m.source == "measured:ina3221:VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0"
    assert r.rails["VDD_GPU_SOC"] == pytest.approx(5.072 * 0.624)  # mV x mA
    assert r.rails["VIN_SYS_5V0"] == pytest.approx(5.064 * 0.851)
    assert r.watts == pytest.approx(5.072 * 0.624 + 5.072 * 0.078 + 5.064 * 0.851)
    assert "VDDQ_VDD2_1V8AO" in r.rails  # read, shown, but not part of the total
    assert r.watts < sum(r.rails.values())


def test_orin_nano_total_is_vdd_in_alone():
    m = Ina3221Meter(tree("orin_nano"))
    r = m.read()
    assert m.source == "measured:ina3221:VDD_IN"
    assert r.watts == pytest.approx(5.048 * 1.040)
    assert set(r.rails) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}
    assert r.watts < sum(r.rails.values())  # the parts are inside VDD_IN: not added again


def test_channel_7_and_nc_rails_are_skipped():
    labels = [(c.device, c.index, c.label) for c in find_channels(tree("agx_orin"))]
    assert labels == [
        ("1-0040", 1, "VDD_GPU_SOC"),
        ("1-0040", 2, "VDD_CPU_CV"),
        ("1-0040", 3, "VIN_SYS_5V0"),
        ("1-0041", 2, "VDDQ_VDD2_1V8AO"),
    ]
    assert (
        (tree("agx_orin") / "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1/in7_label")
        .read_text()
        .startswith("sum of shunt")
    )


def test_limits_come_from_curr_max_and_crit():
    limits = Ina3221Meter(tree("orin_nano")).limits()
    assert limits["VDD_IN"] == {"warn_a": 6.392, "crit_a": 7.784}
    assert limits["VDD_SOC"] == {"warn_a": 1.5, "crit_a": 2.0}


def test_the_older_ina3221x_layout_reads_v_times_i():
    m = Ina3221Meter(tree("tx2_ina3221x"))
    r = m.read()
    assert m.source == "measured:ina3221:VDD_IN"
    assert r.watts == pytest.approx(19.024 * 0.200)  # 3.8048 W; the driver's own in_power0_input says 3804 mW
    assert len(r.rails) == 6
    assert m.limits()["VDD_IN"] == {"warn_a": 2.0, "crit_a": 3.0}
    assert m.describe()["driver"] == "ina3221x"


def test_ina3221x_falls_back_to_the_drivers_power_where_v_or_i_is_missing(tmp_path):
    root = copy_tree("tx2_ina3221x", tmp_path)
    (root / "sys/bus/i2c/drivers/ina3221x/0-0041/iio:device1/in_current0_input").unlink()
    assert Ina3221Meter(root).read().watts == pytest.approx(3.804)


def test_a_board_without_an_input_rail_sums_every_rail_and_says_so():
    assert total_rails(["GPU", "CPU", "SOC"]) == ("GPU", "CPU", "SOC")
    assert total_rails(["POM_5V_IN", "POM_5V_GPU", "POM_5V_CPU"]) == ("POM_5V_IN",)  # Jetson Nano, JetPack 4
    assert board_total({"GPU": 1.0, "CPU": 2.0}) == (3.0, ("GPU", "CPU"))


def test_a_rail_reading_garbage_is_a_read_error_naming_the_file(tmp_path):
    root = copy_tree("orin_nano", tmp_path)
    m = Ina3221Meter(root)
    write(root, "/sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1/curr1_input", "Resource temporarily unavailable")
    with pytest.raises(MeterReadError, match="curr1_input"):
        m.read()


def test_a_rail_that_disappears_is_a_read_error(tmp_path):
    root = copy_tree("agx_orin", tmp_path)
    m = Ina3221Meter(root)
    (root / "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1/in3_input").unlink()
    with pytest.raises(MeterReadError, match="measured:ina3221"):
        m.read()


def test_no_monitor_is_unavailable_with_the_path_it_looked_at():
    with pytest.raises(MeterUnavailableError) as e:
        Ina3221Meter(tree("laptop"))
    assert "ina3221" in str(e.value) and "not a Jetson" in str(e.value)
    assert e.value.code == "meter_unavailable"
