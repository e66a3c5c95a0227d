"""tegrastats lines as JetPack prints them (public logs from AGX Orin and Orin Nano boards; JetPack 5, 6 and 7)."""

from datetime import datetime

import pytest

from edgekit.energy import log_energy, parse_line, parse_log
from edgekit.energy.tegrastats import TegrastatsError

# Jetson AGX Orin 64 GB, L4T R36.4.4 (JetPack 6.2): 12 cores, GR3D with per-GPC frequencies, engines, no VDD_IN
AGX_ORIN_JP6 = (
    "05-09-2026 18:42:06 RAM 18207/62841MB (lfb 466x4MB) SWAP 86/31420MB (cached 0MB) CPU [14%@2188,5%@2112,"
    "8%@2035,14%@2201,46%@1267,47%@1267,2%@1267,10%@1267,4%@1036,5%@1036,6%@1036,10%@1036] EMC_FREQ 3%@2133 "
    "GR3D_FREQ 0%@[0,0] NVENC 79%@166 NVDEC off NVJPG off NVJPG1 off VIC 36%@115 OFA off NVDLA0 off NVDLA1 off "
    "PVA0_FREQ off APE 174 cpu@52.562C soc2@48.437C soc0@49.093C tj@52.562C soc1@49.656C VDD_GPU_SOC 2412mW/2412mW "
    "VDD_CPU_CV 1607mW/1607mW VIN_SYS_5V0 4707mW/4707mW"
)
# Jetson Orin Nano 8 GB dev kit, JetPack 6: 6 cores, VDD_IN
ORIN_NANO_JP6 = (
    "05-05-2025 06:05:39 RAM 2639/7620MB (lfb 9x4MB) SWAP 0/3810MB (cached 0MB) CPU [1%@729,4%@729,8%@729,4%@729,"
    "5%@729,4%@729] GR3D_FREQ 0% cpu@44.156C soc2@43.781C soc0@44.687C gpu@45.968C tj@45.968C soc1@45.312C "
    "VDD_IN 5263mW/5263mW VDD_CPU_GPU_CV 717mW/717mW VDD_SOC 1794mW/1794mW"
)
# AGX Orin 32 GB, JetPack 5: two cores off (a 30 W mode), the fourth rail VDDQ_VDD2_1V8AO, no timestamp
AGX_ORIN_JP5 = (
    "RAM 4096/30536MB (lfb 200x4MB) SWAP 0/15268MB (cached 0MB) CPU [10%@2201,5%@2201,off,off] GR3D_FREQ 0% "
    "cpu@50C soc0@49C VDD_GPU_SOC 3200mW/3210mW VDD_CPU_CV 1600mW/1610mW VIN_SYS_5V0 5000mW/5010mW "
    "VDDQ_VDD2_1V8AO 400mW/400mW"
)
# AGX Orin, JetPack 7.2 (L4T R39.2): rails with a third figure, temperatures with two
AGX_ORIN_JP7 = (
    "07-25-2026 09:08:28 RAM 20642/62817MB (lfb 1x2MB) CPU [23%@2201,10%@2201,4%@2201,14%@2201,30%@2201,18%@2201,"
    "10%@2201,10%@2201,33%@2201,7%@2201,5%@2201,27%@2201] EMC_FREQ 3%@3199 GR3D_FREQ 12%@[1300,1300] NVENC0 off "
    "NVDEC0 off NVJPG0 off NVJPG1 off VIC off OFA off NVDLA0 off NVDLA1 off PVA0_FREQ off APE 174 "
    "cpu@52.968C/52.968C soc2@48.406C/48.406C soc0@49.531C/49.531C gpu@47.625C/47.625C "
    "VDD_GPU_SOC 5139mW/5139mW/5139mW VDD_CPU_CV 3268mW/3268mW/3268mW VIN_SYS_5V0 5500mW/5500mW/5500mW"
)


def test_agx_orin_jetpack6_line():
    s = parse_line(AGX_ORIN_JP6)
    assert s.time == datetime(2026, 5, 9, 18, 42, 6)
    assert (s.ram_used_mb, s.ram_total_mb, s.swap_used_mb, s.swap_total_mb) == (18207, 62841, 86, 31420)
    assert len(s.cpus) == 12 and s.cpus[0].load_pct == 14 and s.cpus[0].mhz == 2188 and s.cpus[-1].mhz == 1036
    assert (s.emc_pct, s.emc_mhz, s.gr3d_pct, s.gr3d_mhz) == (3, 2133, 0, (0, 0))
    assert s.engines["NVENC"] == "79%@166" and s.engines["NVDEC"] == "off" and s.engines["APE"] == "174"
    assert s.temps_c == {"cpu": 52.562, "soc2": 48.437, "soc0": 49.093, "tj": 52.562, "soc1": 49.656}
    assert s.rails_mw == {"VDD_GPU_SOC": (2412, 2412), "VDD_CPU_CV": (1607, 1607), "VIN_SYS_5V0": (4707, 4707)}
    assert s.power_w() == pytest.approx(2.412 + 1.607 + 4.707)
    assert s.source == "measured:tegrastats:VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0"
    assert s.unparsed == ()


def test_orin_nano_jetpack6_line_totals_vdd_in():
    s = parse_line(ORIN_NANO_JP6)
    assert len(s.cpus) == 6 and s.cpu_load_pct == pytest.approx(26 / 6)
    assert s.gr3d_pct == 0 and s.gr3d_mhz == ()
    assert s.temps_c["gpu"] == 45.968
    assert s.power_w() == pytest.approx(5.263)  # VDD_IN only: its parts are not added
    assert s.source == "measured:tegrastats:VDD_IN"


def test_jetpack5_line_with_cores_off_and_now_vs_average():
    s = parse_line(AGX_ORIN_JP5)
    assert s.time is None
    assert [c.load_pct for c in s.cpus] == [10, 5, None, None]
    assert s.cpu_load_pct == 7.5
    assert s.power_w() == pytest.approx(9.8)  # 3.2 + 1.6 + 5.0: VDDQ_VDD2_1V8AO is not in the total
    assert s.power_w(average=True) == pytest.approx(3.21 + 1.61 + 5.01)


def test_jetpack7_line_with_three_figure_rails():
    s = parse_line(AGX_ORIN_JP7)
    assert s.gr3d_pct == 12 and s.gr3d_mhz == (1300, 1300)
    assert s.temps_c["gpu"] == 47.625
    assert s.power_w() == pytest.approx(5.139 + 3.268 + 5.5)


def test_a_powered_down_sensor_has_no_temperature_and_unknown_text_is_kept():
    s = parse_line(ORIN_NANO_JP6.replace("gpu@45.968C", "gpu@-256C") + " FOO_BAR [?]")
    assert s.temps_c["gpu"] is None
    assert s.unparsed == ("FOO_BAR", "[?]")


def test_a_line_that_is_not_tegrastats_is_refused_with_the_line_number(tmp_path):
    with pytest.raises(TegrastatsError, match="not a tegrastats line"):
        parse_line("Segmentation fault (core dumped)")
    log = tmp_path / "tegrastats.log"
    log.write_text(f"{ORIN_NANO_JP6}\n\n{ORIN_NANO_JP6}\ngarbage\n")
    with pytest.raises(TegrastatsError) as e:
        parse_log(log.read_text().splitlines(), log)
    assert str(e.value).startswith(f"{log}: line 4:")


def test_a_log_integrates_to_joules_at_its_interval():
    lines = [ORIN_NANO_JP6, ORIN_NANO_JP6.replace("VDD_IN 5263mW", "VDD_IN 7263mW"), ORIN_NANO_JP6]
    e = log_energy(parse_log(lines), interval_s=0.5)
    assert e.joules == pytest.approx(0.5 * (5.263 + 7.263) / 2 * 2)
    assert e.seconds == 1.0 and e.source == "measured:tegrastats:VDD_IN" and e.samples == 3
