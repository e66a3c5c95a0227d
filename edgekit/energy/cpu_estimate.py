"""An energy estimate from CPU time, for machines with no sensor we can read (a VM, a laptop without root).

The model is Cloud Carbon Footprint's linear one per vCPU (cloudcarbonfootprint.org, methodology, "Energy
Estimate"): a vCPU draws `min_w` idle and `max_w` fully busy, linearly in between. Over a window of `wall`
seconds in which this process used `cpu` CPU-seconds (all its threads: `time.process_time()`) on `vcpus`
vCPUs (its CPU affinity):

    E = vcpus * wall * min_w + cpu * (max_w - min_w)

The default constants are CCF's averages over AWS's CPU micro-architectures (from SPECpower results): 0.74 W idle
and 3.5 W busy per vCPU. They are a stated guess, not a measurement of this machine: every figure from this
model is labelled `estimated:cpu-time-<model>`, and it ranks below any sensor. Pass your own `CpuModel` (for
example a datasheet TDP spread over its cores: `CpuModel.from_tdp("orin-nano-cpu", 7.0, 6)`) when you know better.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from edgekit.cpus import cpu_budget
from edgekit.energy.reading import PowerReading, estimated


@dataclass(frozen=True)
class CpuModel:
    name: str
    min_w: float  # per vCPU, idle
    max_w: float  # per vCPU, 100% busy
    reference: str

    def energy_j(self, cpu_s: float, wall_s: float, vcpus: float) -> float:
        return vcpus * wall_s * self.min_w + cpu_s * (self.max_w - self.min_w)

    @classmethod
    def from_tdp(cls, name: str, tdp_w: float, cores: int, idle_fraction: float = 0.0) -> CpuModel:
        """TDP / cores per busy core; `idle_fraction` of that when idle (0: bill only the work done)."""
        per_core = tdp_w / cores
        return cls(name, per_core * idle_fraction, per_core, f"TDP {tdp_w:g} W over {cores} cores")


CCF_AWS = CpuModel(
    "ccf-aws", 0.74, 3.5, "Cloud Carbon Footprint methodology: average min/max watts per vCPU over AWS CPUs"
)


def process_vcpus() -> float:
    """The vCPUs this process holds: its affinity, or its CPU quota where that is less (a container's `--cpus 1.5`
    holds 1.5; thread counts round it down, the bill does not)."""
    budget = cpu_budget()
    return float(budget.affinity) if budget.quota is None else min(float(budget.affinity), budget.quota)


class CpuTimeMeter:
    """This process's estimated energy as a counter meter (joules since it was opened). Never fails: the last
    fallback of every sampler."""

    def __init__(self, model: CpuModel = CCF_AWS, vcpus: float | None = None):
        self.model = model
        self.vcpus = vcpus or process_vcpus()
        self.source = estimated(f"cpu-time-{model.name}")
        self._t0, self._cpu0 = time.monotonic(), time.process_time()
        self._last = (self._t0, 0.0)

    def read(self) -> PowerReading:
        t, cpu = time.monotonic(), time.process_time()
        joules = self.model.energy_j(cpu - self._cpu0, t - self._t0, self.vcpus)
        t0, j0 = self._last
        self._last = (t, joules)
        return PowerReading((joules - j0) / (t - t0) if t > t0 else None, self.source, t, energy_j=joules)

    def describe(self) -> dict:
        return {
            "source": self.source,
            "kind": "estimate",
            "model": asdict(self.model),
            "vcpus": self.vcpus,
            "formula": "vcpus * wall_s * min_w + process_cpu_s * (max_w - min_w)",
        }
