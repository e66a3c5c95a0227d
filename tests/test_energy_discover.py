"""Which meter each machine gets, what pareto.json is told about it, the labels, the CPU-time estimate and a
target's emulated energy read from its cost."""

import time

import pytest

from edgekit.energy import (
    CCF_AWS,
    CpuModel,
    CpuTimeMeter,
    MeterReadError,
    MeterUnavailableError,
    check_source,
    describe_machine,
    discover_meters,
    energy_from_cost,
    find_meters,
    kind_of,
    open_meter,
    open_sampler,
    weakest,
)
from edgekit.errors import ConfigError

from energy_trees import tree


@pytest.mark.parametrize(
    "board, source",
    [
        ("agx_orin", "measured:ina3221:VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0"),
        ("orin_nano", "measured:ina3221:VDD_IN"),
        ("tx2_ina3221x", "measured:ina3221:VDD_IN"),
        ("laptop", "measured:rapl:package-0"),
    ],
)
def test_the_best_meter_per_machine(board, source):
    assert open_meter("auto", tree(board)).source == source
    meters = discover_meters(tree(board))
    assert meters[0].source == source
    assert meters[-1].source == "estimated:cpu-time-ccf-aws"  # always there, always last


def test_a_bare_tree_gets_the_estimate_and_says_why_nothing_else(tmp_path):
    meters, missing = find_meters(tmp_path)
    assert [m.source for m in meters] == ["estimated:cpu-time-ccf-aws"]
    assert {x["meter"] for x in missing} == {"ina3221", "nvml", "rapl"}
    with pytest.raises(MeterUnavailableError, match="no RAPL package zone"):
        open_meter("rapl", tmp_path)
    with pytest.raises(ConfigError, match="unknown energy meter 'joulemeter'"):
        open_meter("joulemeter", tmp_path)


def test_a_sampler_on_a_named_meter_falls_back_along_the_rest():
    s = open_sampler("cpu-time", tree("laptop"), interval_s=0.2)
    assert [m.source for m in s.meters] == ["estimated:cpu-time-ccf-aws", "measured:rapl:package-0"]
    s = open_sampler(root=tree("agx_orin"))
    assert s.source.startswith("measured:ina3221:") and s.meters[-1].source.startswith("estimated:")
    assert s.interval_s == 0.05


def test_the_machine_description_for_a_profile():
    d = describe_machine(tree("agx_orin"))
    assert d["model"] == "NVIDIA Jetson AGX Orin Developer Kit"
    assert d["power_mode"] == {"id": 3, "name": "MODE_50W", "source": "/var/lib/nvpmodel/status + /etc/nvpmodel.conf"}
    assert d["thermal_headroom_c"]["zone"] == "tj-thermal"
    assert d["meters"]["chosen"] == "measured:ina3221:VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0"
    ina = d["meters"]["available"][0]
    assert ina["total"] == ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"] and "carrier board" in ina["note"]
    assert {r["name"] for r in ina["rails"]} == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert d["arch"] is None  # a fixture tree says nothing about the host running the test


def test_labels():
    for good in ("measured:ina3221:VDD_IN", "emulated:x1", "estimated:cpu-time-ccf-aws"):
        assert check_source(good) == good
    for bad in ("ina3221", "measured:", "guessed:x", "measured:two words", None):
        with pytest.raises(ValueError):
            check_source(bad)
    assert kind_of("emulated:x1") == "emulated"
    assert weakest(["measured:rapl:package-0", "estimated:cpu-time-ccf-aws"]) == "estimated:cpu-time-ccf-aws"
    assert weakest(["emulated:x1", "measured:nvml:gpu0"]) == "emulated:x1"


def test_the_cpu_time_model():
    assert CCF_AWS.energy_j(cpu_s=2.0, wall_s=1.0, vcpus=4) == pytest.approx(4 * 0.74 + 2.0 * (3.5 - 0.74))
    tdp = CpuModel.from_tdp("orin-nano-cpu", 7.0, 6)
    assert tdp.energy_j(cpu_s=3.0, wall_s=10.0, vcpus=6) == pytest.approx(3.0 * 7.0 / 6)  # no idle share


def test_the_cpu_time_meter_bills_busy_time_above_idle():
    c0, t0 = time.process_time(), time.monotonic()  # the meter's window: CPU any thread of this process spends in it
    m = CpuTimeMeter(vcpus=1)
    time.sleep(0.1)
    idle = m.read()
    sum(i * i for i in range(300_000))
    busy = m.read()
    wall, cpu = busy.t - t0, time.process_time() - c0
    assert busy.energy_j > idle.energy_j > 0
    assert busy.energy_j == pytest.approx(0.74 * wall + cpu * 2.76, rel=0.2, abs=0.05)
    assert m.source == "estimated:cpu-time-ccf-aws"


def test_a_targets_emulated_energy_is_read_from_its_cost():
    # the shape of the x1 backend's take_cost(): energy_j plus the label it bills under
    cost = {"energy_j": 0.0123, "figure_source": "emulated:x1", "latency_ms": 41.0, "mj_total": 12.3}
    e = energy_from_cost(cost)
    assert (e.joules, e.source, e.seconds) == (0.0123, "emulated:x1", 0.041)
    legacy = energy_from_cost({"mj_total": 12.3, "emulated_ms_total": 41.0, "figure_source": "emulated:x1"})
    assert legacy.joules == pytest.approx(0.0123)
    assert energy_from_cost({"decode_steps": 3}) is None  # a backend that measures nothing
    with pytest.raises(MeterReadError, match="figure_source"):
        energy_from_cost({"energy_j": 1.0, "source": "edgekit x1 emulator"})
    with pytest.raises(MeterReadError, match="finite"):
        energy_from_cost({"energy_j": float("nan"), "figure_source": "emulated:x1"})
