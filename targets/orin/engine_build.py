"""`edgekit engine build`: the bundle's graphs into TensorRT engines on the Jetson, cached per device.

Everything that can refuse does so before TensorRT is touched: a bundle for another target, a plan override that
is wrong, a node the capability check refuses (DLA constraints included for DLA-planned graphs). Then, per graph:
TensorRT's ONNX parser reads the file (`parse_from_file`: the weights are not copied into Python), a strongly typed
network (`trt_import.strongly_typed_flags`), the plan's optimisation profiles, workspace, builder optimisation
level, sparse weights and DLA core with GPU fallback, the shared timing cache, a progress monitor, and the
serialized engine written atomically into the cache (`engine_cache`). One graph is built at a time and its builder
freed before the next, and the peak resident memory of the process (getrusage) is stated in the engine record.

Written against the TensorRT 10.3 Python API; runs only where TensorRT is installed (tests skip with
`trt_import.TRT_MISSING`).
"""

from __future__ import annotations

import gc
import logging
import resource
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from edgekit import names
from edgekit.bundle import sha256_file
from edgekit.bundle.io import replace_bytes
from edgekit.errors import BundleError, ConfigError

from .capability import check_file, refuse_unsupported
from .device import DeviceFacts, current_facts, state_dir
from .engine_cache import EngineCache, bundle_id
from .plan import dla_roles, plan_for
from .profiles import is_static
from .trt_import import dla_supported, import_tensorrt, strongly_typed_flags

if TYPE_CHECKING:
    import tensorrt as trt

Progress = Callable[[str, int, int], None]  # (phase, step, steps)
PLAN_SUMMARY = ("max_batch", "workspace_mib", "builder_optimization_level", "devices", "dla_core", "sparse_weights")
RSS_SOURCE = "getrusage(RUSAGE_SELF).ru_maxrss: peak resident memory of this process, parsing and building included"
log = logging.getLogger("edgekit.orin")


def require_orin(bundle) -> None:
    if bundle.target != "orin":
        raise BundleError(
            f"this bundle is for target '{bundle.target}', not orin: build one with `edgekit build --target orin`",
            bundle.source,
        )


def peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # KiB on Linux


def preflight(bundle, overrides: dict | None = None) -> dict:
    """The plan with overrides, after every check that needs no GPU: target, plan, capability (and DLA)."""
    require_orin(bundle)
    plan = plan_for(bundle, overrides)
    dla = set(dla_roles(plan))
    reports = [
        check_file(
            bundle.component(role),
            dla=role in dla,
            dla_static=is_static(plan["profiles"].get(role, [])),
            gpu_fallback=bool(plan["gpu_fallback"]),
        )
        for role in bundle.graph_roles
    ]
    refuse_unsupported(reports, bundle.root)
    plan["_capability"] = {r.graph: {"nodes": r.nodes, "findings": len(r.findings)} for r in reports}
    return plan


def _monitor(progress: Progress | None, graph: str) -> trt.IProgressMonitor | None:
    """A TensorRT IProgressMonitor (10.x) that forwards builder phases; None where the API lacks it."""
    import tensorrt as trt

    if progress is None or not hasattr(trt, "IProgressMonitor"):
        return None
    report = progress

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.steps: dict[str, int] = {}

        # parent_phase: None for a top-level phase (the stubs say str)
        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.steps[phase_name] = num_steps
            report(f"{graph}: {phase_name}", 0, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            report(f"{graph}: {phase_name}", step + 1, self.steps.get(phase_name, step + 1))
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            pass

    return Monitor()


def _parse(network: trt.INetworkDefinition, logger: trt.ILogger, path: Path) -> trt.OnnxParser:
    import tensorrt as trt

    parser = trt.OnnxParser(network, logger)
    if parser.parse_from_file(str(path)):
        return parser
    errors = [parser.get_error(i) for i in range(parser.num_errors)]
    first = errors[0] if errors else None
    node = getattr(first, "node_name", lambda: "")() if first is not None else ""
    desc = first.desc() if first is not None else "no error reported"
    where = f" at node '{node}'" if node else ""
    raise ConfigError(f"TensorRT's ONNX parser refused the graph{where}: {desc}", path)


def build_engine(
    path: Path, role: str, plan: dict, timing: bytes, progress: Progress | None
) -> tuple[trt.IHostMemory, bytes]:
    """One serialized engine (IHostMemory) and the serialized timing cache after it."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(strongly_typed_flags())
    parser = _parse(network, logger, path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(plan["workspace_mib"]) << 20)
    config.builder_optimization_level = int(plan["builder_optimization_level"])
    if plan["sparse_weights"]:
        config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)  # used only where TensorRT times a sparse tactic faster
    if plan["devices"].get(role) == "dla" and dla_supported(trt.__version__):
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = int(plan["dla_core"])
        if plan["gpu_fallback"]:
            config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    cache = config.create_timing_cache(timing)
    config.set_timing_cache(cache, False)  # ignore_mismatch=False: a cache from another device is not used
    for prof in plan["profiles"][role]:
        profile = builder.create_optimization_profile()
        for name, s in prof["shapes"].items():
            profile.set_shape(name, s["min"], s["opt"], s["max"])
        config.add_optimization_profile(profile)
    monitor = _monitor(progress, path.name)
    if monitor is not None:
        config.progress_monitor = monitor
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise ConfigError("TensorRT could not build an engine for this graph (its log above says why)", path)
    timing_out = bytes(memoryview(config.get_timing_cache().serialize()))
    del parser, network, config, builder
    return engine, timing_out


def build_engines(
    bundle,
    *,
    state: str | None = None,
    overrides: dict | None = None,
    force: bool = False,
    progress: Progress | None = None,
    say: Callable[[str], None] = lambda _m: None,
    facts: DeviceFacts | None = None,
) -> dict:
    """Build (or find up to date) the engines of `bundle` for this device; returns the engine record."""
    plan = preflight(bundle, overrides)
    plan.pop("_capability")
    import_tensorrt()  # one line where TensorRT is missing or older than 10.3
    import tensorrt as trt

    facts = facts or current_facts()
    cache = EngineCache(state_dir(state), bundle_id(bundle, plan), facts)
    if not force and cache.is_complete():
        say(f"engines up to date: {cache.folder}")
        return {**(cache.read_meta() or {}), "up_to_date": True}
    if plan["devices"] != {r: "gpu" for r in names.GRAPH_ROLES} and not dla_supported(trt.__version__):
        say(f"TensorRT {trt.__version__} has no DLA support: the DLA-planned graphs build for the GPU")
    timing = cache.timing_cache.read_bytes() if cache.timing_cache.is_file() else b""
    engines, started = {}, time.perf_counter()
    for role in bundle.graph_roles:
        path = bundle.component(role)
        say(f"building {path.name} ({', '.join(p['name'] for p in plan['profiles'][role])})")
        t0 = time.perf_counter()
        serialized, timing = build_engine(path, role, plan, timing, progress)
        out = cache.engine(role)
        size = replace_bytes(out, memoryview(serialized))
        del serialized
        gc.collect()
        replace_bytes(cache.timing_cache, timing)
        engines[role] = {
            "file": out.name,
            "bytes": size,
            "sha256": sha256_file(out),
            "seconds": round(time.perf_counter() - t0, 2),
            "profiles": [p["name"] for p in plan["profiles"][role]],
            "device": plan["devices"].get(role, "gpu"),
            "peak_host_rss_mib": peak_rss_mib(),
        }
    meta = {
        "bundle": cache.bundle,
        "facts": facts.to_dict(),
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 2),
        "network": "strongly typed",
        "plan": {k: plan[k] for k in PLAN_SUMMARY},
        "timing_cache": str(cache.timing_cache),
        "engines": engines,
        "peak_host_rss_mib": peak_rss_mib(),
        "peak_host_rss_source": RSS_SOURCE,
    }
    cache.write_meta(meta)
    return meta


def ensure_engines(bundle, *, state: str | None = None, overrides: dict | None = None) -> dict | None:
    """The run side's first load on a device (edgekitd's first start): build the engines when this device's
    cache has none for this bundle and plan; None when a record is there (the backend then checks it and refuses
    a damaged or foreign one in one line, as `edgekit engine build --rebuild` is the fix, not a silent rebuild)."""
    plan = plan_for(bundle, overrides)
    facts = current_facts()
    cache = EngineCache(state_dir(state), bundle_id(bundle, plan), facts)
    if cache.read_meta() is not None:
        return None
    log.warning("no TensorRT engines for %s on this device: building them into %s (once)", bundle.name, cache.folder)

    def phase(name: str, step: int, steps: int) -> None:
        if step == 0:
            log.info("engine build: %s (%d steps)", name, steps)

    meta = build_engines(bundle, state=state, overrides=overrides, progress=phase, say=log.info, facts=facts)
    seconds, rss = meta["seconds"], meta["peak_host_rss_mib"]
    log.warning("engines built for %s in %.0f s (peak host memory %.0f MiB)", bundle.name, seconds, rss)
    return meta


def dry_run(bundle, *, state: str | None = None, overrides: dict | None = None, root: str = "/") -> dict:
    """What `build_engines` would do, with every check that needs no GPU; reports the device facts it can read."""
    from .device import read_device_model, read_l4t
    from .trt_import import DeviceRuntimeMissing

    plan = preflight(bundle, overrides)
    capability = plan.pop("_capability")
    trt_version: str | None
    missing: str | None
    try:
        trt_version = import_tensorrt().__version__
    except DeviceRuntimeMissing as err:
        trt_version = None
        missing = err.reason
    else:
        missing = None
    out = {
        "bundle": str(bundle.source),
        "bundle_id": bundle_id(bundle, plan),
        "state_dir": str(state_dir(state)),
        "device": {
            "tensorrt": trt_version or missing,
            "l4t": read_l4t(root) or "not a Jetson (no /etc/nv_tegra_release)",
        },
        "plan": {k: plan[k] for k in PLAN_SUMMARY},
        "profiles": {role: [p["name"] for p in profs] for role, profs in plan["profiles"].items()},
        "capability": capability,
    }
    model = read_device_model(root)
    if model:
        out["device"]["model"] = model
    return out
