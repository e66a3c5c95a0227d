"""How many threads ORT should use: one per physical core we may run on, within the cgroup's CPU quota.

Hyper-threads share a core's FMA units, so a GEMV-bound decoder gains nothing from them and loses to contention;
ORT's own default counts them. We count distinct (package, core) pairs among the CPUs this process may use, and
never more than its CPU quota allows (`edgekit.cpus`: ORT's pool threads spin, and past the quota they are
throttled).
"""

from __future__ import annotations

import os
from functools import lru_cache

from edgekit.cpus import usable_cpus


@lru_cache(maxsize=1)
def physical_cores() -> int:
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    try:
        cpu = package = core = None
        with open("/proc/cpuinfo") as f:
            for line in [*f, "\n"]:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    package = value
                elif key == "core id":
                    core = value
                elif not key and cpu is not None:
                    if cpu in allowed:
                        cores.add((package or "0", core if core is not None else str(cpu)))
                    cpu = package = core = None
    except OSError:
        pass
    return max(1, min(len(cores) or len(allowed), len(allowed), usable_cpus()))


def serving_threads() -> int:
    """ORT threads for a model served beside the studies' decode (edgekitd, and `edgekit pareto`, which measures
    what edgekitd serves): half the physical cores, at least 1; the ingest processes are sized from half the cores
    too (`edgekit.ingest.workers.default_processes`). On 2 cores one thread served c=8 at 1.28x the req/s of two
    (`bench/daemon_threads.py`)."""
    return max(1, physical_cores() // 2)
