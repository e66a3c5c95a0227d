"""How edgekitd shares the CPUs it may keep busy (`edgekit.cpus`) between the model and the studies' decode.

ONNX Runtime's pool threads spin after each run, waiting for the next one; in the daemon that CPU is what its ingest
processes and HTTP server need between the model's runs. With ONNX Runtime's defaults (a thread per physical core,
spinning), edgekitd on the 2-core host answered at c=1 in 44-50 ms p50 against 28 ms now, and served 49-50 req/s at
c=8 against 76-79 (`bench/daemon_threads.py`). So by default the model gets half the physical cores (the ingest
processes are sized from half the cores too, 2 to 4: `intake.ingest_processes`), and its pool threads stop spinning
at the end of each run. On 2 cores that is one thread, which has no pool to spin: there the gain is the thread
count, and the spinning matters where the model has two threads or more (two threads spinning: c=1 44-50 ms; not
spinning: 27-28). Both are settings: `[daemon] threads` and `ort_spinning`; `edgekit pareto` measures points the
same way (`edgekit.pareto.measure`), so the policy's and the canary's figures are the daemon's.
"""

from __future__ import annotations

from .config import DaemonConfig


def model_threads(cfg: DaemonConfig) -> int:
    """ONNX Runtime's intra-op threads per loaded variant: the configured count, else half the physical cores this
    process may keep busy, at least one (`edgekit.ort.serving_threads`, which `edgekit pareto` measures at too)."""
    if cfg.threads is not None:
        return cfg.threads
    from edgekit.ort import serving_threads

    return serving_threads()


def plan(cfg: DaemonConfig, ingest_processes: int) -> str:
    """The start-up line: what the threads were sized from (a CPU quota caps them: systemd's CPUQuota=, a
    container's limit)."""
    from edgekit.cpus import cpu_budget

    set_by = " (set in the config)" if cfg.threads is not None else ""
    spinning = "spinning between runs" if cfg.ort_spinning else "not spinning between runs"
    return (
        f"CPUs: {cpu_budget().describe()}; ONNX Runtime threads per variant: {model_threads(cfg)}{set_by}, "
        f"{spinning}; ingest processes: {ingest_processes}"
    )
