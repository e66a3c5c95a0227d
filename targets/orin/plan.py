"""The build plan: how `edgekit engine build` turns the bundle's graphs into engines, written once at
`edgekit build` time into the manifest's `runtime` section (the run side and the engine builder read it, a
request may override the keys `OVERRIDABLE` names).

Precision is not a builder flag here: the networks are strongly typed (TensorRT 10's
`NetworkDefinitionCreationFlag.STRONGLY_TYPED`, the only kind TensorRT 11 has), so the graphs' own types decide
(`trt_graphs.py`). The plan says which graphs go to the DLA (none by default: the encoder's transformer layers are
not DLA layers, `capability.DLA_OPS`), the optimisation profiles, the workspace, the builder optimisation level,
sparse weights (asked for when the recipe made 2:4 weights; TensorRT uses sparse tactics only where it times them
faster) and the parity tolerances `edgekit engine check` applies.

`max_batch` is the most rows one decode step carries (`profiles`): recorded at build time (the engine's default,
8), it may be overridden for an engine build and for a run (`edgekit engine build --max-batch N`, the run setting
`max_batch`); `plan_for` then remakes the profiles from the bundle's graphs at that batch, so the engines, the
ONNX Runtime reference and the engine cache key all follow it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgekit import names
from edgekit.errors import ConfigError

from .profiles import DEFAULT_MAX_BATCH, Limits, graph_paths, make_profiles

TENSORRT_MIN = "10.3"
DEFAULTS: dict[str, Any] = {
    "tensorrt_min": TENSORRT_MIN,
    "strongly_typed": True,
    "precision": {},
    "profiles": {},
    "limits": {},
    "max_batch": DEFAULT_MAX_BATCH,
    "workspace_mib": 1024,
    "builder_optimization_level": 3,
    "devices": {role: "gpu" for role in names.GRAPH_ROLES},
    "dla_core": None,
    "gpu_fallback": True,
    "sparse_weights": False,
    "parity_tolerance": {"rel_l2": 0.03, "logits_top1": 0.95},
    "quality_floor": {"finding_f1": None, "max_drop": 0.01},
}
OVERRIDABLE = ("workspace_mib", "builder_optimization_level", "devices", "dla_core", "gpu_fallback", "max_batch")
MAX_BATCH_LIMIT = 64  # beyond this a decode profile is a typo, not a plan


def make_plan(*, profiles: dict, limits: Limits, precision: dict, sparse: bool) -> dict[str, Any]:
    return {
        **DEFAULTS,
        "profiles": profiles,
        "limits": dataclasses.asdict(limits),
        "max_batch": limits.max_batch,
        "precision": precision,
        "sparse_weights": sparse,
    }


def with_overrides(plan: dict, overrides: dict, where) -> dict:
    """The bundle's plan with a request's overrides (unknown or fixed keys refused by name), validated."""
    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise ConfigError(
            f"these orin settings cannot be overridden: {', '.join(bad)} (can: {', '.join(OVERRIDABLE)})", where
        )
    # a bundle written before `max_batch` was a plan key: its profiles' batch, not today's default
    recorded = plan.get("max_batch", plan.get("limits", {}).get("max_batch", DEFAULT_MAX_BATCH))
    merged = {**DEFAULTS, **plan, "max_batch": recorded, **overrides}
    batch = merged["max_batch"]
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH_LIMIT:
        raise ConfigError(f"max_batch must be an integer in [1, {MAX_BATCH_LIMIT}], got {batch!r}", where)
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


def plan_for(bundle, overrides: dict | None = None) -> dict:
    """The bundle's plan with a request's overrides (`with_overrides`); with a `max_batch` other than the one its
    profiles were made for, the profiles made again from the bundle's graphs and recorded limits at that batch."""
    plan = with_overrides(bundle.manifest.runtime, overrides or {}, bundle.source)
    limits = plan.get("limits") or {}
    if limits and plan["max_batch"] != limits.get("max_batch"):
        at = Limits(**{**limits, "max_batch": plan["max_batch"]})
        plan["profiles"] = make_profiles(graph_paths(bundle.root), at)
        plan["limits"] = dataclasses.asdict(at)
    return plan


def dla_roles(plan: dict) -> list[str]:
    return [role for role, dev in plan.get("devices", {}).items() if dev == "dla"]
