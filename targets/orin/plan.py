"""The build plan: how `edgekit engine build` turns the bundle's graphs into engines, written once at
`edgekit build` time into the manifest's `runtime` section (the run side and the engine builder read it, a
request may override the keys `OVERRIDABLE` names).

Precision is not a builder flag here: the networks are strongly typed (TensorRT 10's
`NetworkDefinitionCreationFlag.STRONGLY_TYPED`, the only kind TensorRT 11 has), so the graphs' own types decide
(`trt_graphs.py`). The plan says which graphs go to the DLA (none by default: the encoder's transformer layers are
not DLA layers, `capability.DLA_OPS`), the optimisation profiles, the workspace, the builder optimisation level,
sparse weights (asked for when the recipe made 2:4 weights; TensorRT uses sparse tactics only where it times them
faster) and the parity tolerances `edgekit engine check` applies.
"""

from __future__ import annotations

from typing import Any

from edgekit import names
from edgekit.errors import ConfigError

TENSORRT_MIN = "10.3"
DEFAULTS: dict[str, Any] = {
    "tensorrt_min": TENSORRT_MIN,
    "strongly_typed": True,
    "precision": {},
    "profiles": {},
    "limits": {},
    "workspace_mib": 1024,
    "builder_optimization_level": 3,
    "devices": {role: "gpu" for role in names.GRAPH_ROLES},
    "dla_core": None,
    "gpu_fallback": True,
    "sparse_weights": False,
    "parity_tolerance": {"rel_l2": 0.03, "logits_top1": 0.95},
    "quality_floor": {"finding_f1": None, "max_drop": 0.01},
}
OVERRIDABLE = ("workspace_mib", "builder_optimization_level", "devices", "dla_core", "gpu_fallback")


def make_plan(*, profiles: dict, limits: dict, precision: dict, sparse: bool) -> dict[str, Any]:
    return {**DEFAULTS, "profiles": profiles, "limits": limits, "precision": precision, "sparse_weights": sparse}


def with_overrides(plan: dict, overrides: dict, where) -> dict:
    """The bundle's plan with a request's overrides (unknown or fixed keys refused by name), validated."""
    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise ConfigError(
            f"these orin settings cannot be overridden: {', '.join(bad)} (can: {', '.join(OVERRIDABLE)})", where
        )
    merged = {**DEFAULTS, **plan, **overrides}
    level = merged["builder_optimization_level"]
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 5:
        raise ConfigError(f"builder_optimization_level must be 0..5, got {level!r}", where)
    ws = merged["workspace_mib"]
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 16:
        raise ConfigError(f"workspace_mib must be an integer >= 16, got {ws!r}", where)
    core = merged["dla_core"]
    if core is not None and (isinstance(core, bool) or not isinstance(core, int) or core not in (0, 1)):
        raise ConfigError(f"dla_core must be 0 or 1 (Orin has two DLA cores) or null, got {core!r}", where)
    devices = merged["devices"]
    if not isinstance(devices, dict) or set(devices) - set(names.GRAPH_ROLES):
        raise ConfigError(f"devices must map graph roles ({', '.join(names.GRAPH_ROLES)}) to gpu or dla", where)
    for role, dev in devices.items():
        if dev not in ("gpu", "dla"):
            raise ConfigError(f"devices.{role} must be gpu or dla, got {dev!r}", where)
        if dev == "dla" and core is None:
            raise ConfigError(f"devices.{role} is dla but no dla_core is set (0 or 1)", where)
    return merged


def dla_roles(plan: dict) -> list[str]:
    return [role for role, dev in plan.get("devices", {}).items() if dev == "dla"]
