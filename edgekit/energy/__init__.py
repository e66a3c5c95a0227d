"""Energy meters: what a report cost in joules, and where that figure comes from.

One interface (`Meter.read() -> PowerReading`), every figure labelled `measured:<sensor>`, `emulated:<model>` or
`estimated:<model>` (`reading.py`). Readers, each taking a root directory so tests read fixture trees with the
real layout: the Jetson INA3221 (`ina3221.py`, both driver layouts), RAPL (`rapl.py`), NVML (`nvml.py`, optional
nvidia-ml-py), the CPU-time estimate (`cpu_estimate.py`), a target's own emulated energy (`emulated.py`), the
tegrastats log parser (`tegrastats.py`), batteries (`power_supply.py`), thermal zones (`thermal.py`) and the
Jetson power mode (`nvpmodel.py`). `sampler.py` integrates a meter into joules per report window with fallback
along a list of meters; `discover.py` picks the best meter here and describes the machine; `conditions.py` reads
the policy's signals in one call.

    sampler = open_sampler().start()          # the best meter here, falling back to the CPU-time estimate
    with sampler.window() as w:
        ...                                   # one report
    w.joules, w.source                        # 1.93, "measured:ina3221:VDD_IN"
"""

from edgekit.energy.conditions import Conditions, read_conditions
from edgekit.energy.cpu_estimate import CCF_AWS, CpuModel, CpuTimeMeter
from edgekit.energy.discover import (
    METERS,
    describe_machine,
    discover_meters,
    find_meters,
    open_meter,
    open_sampler,
)
from edgekit.energy.emulated import energy_from_cost
from edgekit.energy.ina3221 import Ina3221Meter
from edgekit.energy.nvml import NvmlMeter
from edgekit.energy.nvpmodel import PowerMode, power_mode
from edgekit.energy.power_supply import BatteryState, PowerSupply, battery_state, read_supplies
from edgekit.energy.rapl import RaplMeter
from edgekit.energy.reading import (
    KINDS,
    EnergyReading,
    Meter,
    MeterReadError,
    MeterUnavailableError,
    PowerReading,
    check_source,
    emulated,
    estimated,
    kind_of,
    measured,
    rank,
    weakest,
)
from edgekit.energy.sampler import DEFAULT_INTERVAL_S, Sampler, Window
from edgekit.energy.tegrastats import TegrastatsSample, log_energy, parse_line, parse_log
from edgekit.energy.thermal import ThermalZone, TripPoint, headroom_c, read_zones

__all__ = [
    "CCF_AWS",
    "DEFAULT_INTERVAL_S",
    "KINDS",
    "METERS",
    "BatteryState",
    "Conditions",
    "CpuModel",
    "CpuTimeMeter",
    "EnergyReading",
    "Ina3221Meter",
    "Meter",
    "MeterReadError",
    "MeterUnavailableError",
    "NvmlMeter",
    "PowerMode",
    "PowerReading",
    "PowerSupply",
    "RaplMeter",
    "Sampler",
    "TegrastatsSample",
    "ThermalZone",
    "TripPoint",
    "Window",
    "battery_state",
    "check_source",
    "describe_machine",
    "discover_meters",
    "emulated",
    "energy_from_cost",
    "estimated",
    "find_meters",
    "headroom_c",
    "kind_of",
    "log_energy",
    "measured",
    "open_meter",
    "open_sampler",
    "parse_line",
    "parse_log",
    "power_mode",
    "rank",
    "read_conditions",
    "read_supplies",
    "read_zones",
    "weakest",
]
