"""A discrete NVIDIA GPU's own energy counter through NVML (nvidia-ml-py, imported as `pynvml`; optional).

`nvmlDeviceGetTotalEnergyConsumption` counts mJ since the driver was loaded (Volta and newer; older GPUs raise
NotSupported), as an unsigned 64-bit number that does not wrap in practice; a smaller value than the last one
means the driver was reloaded, and the meter gives up rather than bill a negative report. Instantaneous power
comes from `nvmlDeviceGetPowerUsage` (mW). This is the GPU board only, not the host. Jetson has no NVML: its
meter is the INA3221 (`edgekit.energy.ina3221`).
"""

from __future__ import annotations

import time

from edgekit.energy.counters import Unwrapper
from edgekit.energy.reading import MeterReadError, MeterUnavailableError, PowerReading, measured


def import_pynvml():
    """The pynvml module, or MeterUnavailableError saying how to get it."""
    try:
        import pynvml
    except ImportError:
        raise MeterUnavailableError(
            "NVML meter needs nvidia-ml-py (pip install nvidia-ml-py; import name pynvml)", "pynvml"
        ) from None
    return pynvml


class NvmlMeter:
    """GPU `index`'s total energy as a counter meter."""

    def __init__(self, index: int = 0):
        self.nvml = import_pynvml()
        try:
            self.nvml.nvmlInit()
            self.handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
            name = self.nvml.nvmlDeviceGetName(self.handle)
            first = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except self.nvml.NVMLError as e:
            raise MeterUnavailableError(f"NVML GPU {index}: {e}", "libnvidia-ml.so.1") from None
        self.index, self.name = index, name.decode() if isinstance(name, bytes) else str(name)
        self.source = measured(f"nvml:gpu{index}")
        self._counter = Unwrapper(first, None)

    def read(self) -> PowerReading:
        t = time.monotonic()
        try:
            mj = self._counter.update(int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)))
            mw = self.nvml.nvmlDeviceGetPowerUsage(self.handle)
        except self.nvml.NVMLError as e:
            raise MeterReadError(f"{self.source}: {e}") from e
        return PowerReading(mw / 1e3, self.source, t, energy_j=mj / 1e3)

    def describe(self) -> dict:
        return {
            "source": self.source,
            "kind": "energy counter",
            "gpu": self.name,
            "index": self.index,
            "note": "the GPU board only (nvmlDeviceGetTotalEnergyConsumption), not the host",
        }
