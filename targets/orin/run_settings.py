"""The settings the orin run side takes (`RuntimeOptions.settings`), checked before anything loads.

- `engine`: `tensorrt` (default: the cached engines on a Jetson) or `onnxruntime` (the same graphs in ONNX Runtime
  on any machine: the reference the engines are held to);
- `estimate`: `DEVICE:MODE` (e.g. `agx-orin-64:MAXN`): bill each report by the Orin cost model for that device and
  power mode (`estimate_billing`), so an Orin front can be drawn before anyone holds an Orin. It needs
  `engine=onnxruntime`: on a Jetson the board's own meter measures TensorRT, and an estimate must not pass for that;
- `max_batch`: the most rows one decode step carries (`plan`: the profiles are remade at it), for either engine,
  so the ONNX Runtime reference takes the batches the engines would;
- the other plan keys a request may override (`plan.OVERRIDABLE`: workspace, optimisation level, DLA), for
  TensorRT only.
Unknown keys are refused by name (`edgekit.target.runtime_settings`), and so is a setting the chosen engine ignores.

`RuntimeOptions.engine` (what `edgekit run | eval | profile --engine onnxruntime` sets, off the device) names the
engine too, and then the run is billed by the Orin estimate even when no `estimate` is given (the cost model's
default device and mode, `estimate.DEFAULT_DEVICE`:`DEFAULT_MODE`): an Orin bundle run off the device states
estimated Orin figures, labelled so, rather than none. The two must agree when both are given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgekit.errors import ConfigError
from edgekit.target import runtime_settings

from .plan import DEFAULTS as PLAN_DEFAULTS
from .plan import OVERRIDABLE

ENGINES = ("tensorrt", "onnxruntime")
BOTH_ENGINES = ("max_batch",)  # plan keys that mean the same to the ONNX Runtime reference
RUN_DEFAULTS: dict[str, Any] = {"engine": "tensorrt", "estimate": None}
DEFAULTS: dict[str, Any] = {**RUN_DEFAULTS, **{k: PLAN_DEFAULTS[k] for k in OVERRIDABLE}}


@dataclass(frozen=True)
class RunSettings:
    engine: str = "tensorrt"
    estimate: tuple[str, str] | None = None  # (device id, mode name), canonical
    plan_overrides: dict[str, Any] = field(default_factory=dict)  # only the keys the request set


def known_estimates() -> str:
    """Every device and its modes, for one line: `agx-orin-64:MAXN|50W|30W|15W, orin-nano-8:15W|7W, ...`."""
    from .estimate import known_devices

    return ", ".join(f"{dev}:{'|'.join(modes)}" for dev, modes in known_devices().items())


def parse_estimate(text: str, where=None) -> tuple[str, str]:
    """`DEVICE:MODE` -> (device id, mode name) as the cost model names them (`AGX64:maxn` -> agx-orin-64, MAXN);
    anything else is one line listing the known devices and their modes."""
    from .estimate import get_device

    device, sep, mode = str(text).strip().partition(":")
    try:
        if not sep or not device or not mode:
            raise ConfigError("expected DEVICE:MODE")
        dev = get_device(device)
        return dev.id, dev.mode(mode).name
    except ConfigError:
        raise ConfigError(f"unknown Orin estimate '{text}' (DEVICE:MODE, known: {known_estimates()})", where) from None


def canonical_estimate(text: str, where=None) -> str:
    """The `DEVICE:MODE` spelling the cost model uses, so one configuration has one name (pareto point ids)."""
    return ":".join(parse_estimate(text, where))


def read_settings(overrides: Mapping[str, Any], where, engine: str | None = None) -> RunSettings:
    """A request's settings, checked: unknown keys, an unknown engine or estimate, and settings the chosen engine
    would ignore are each refused in one line naming `where` (the bundle). `engine`: the run's
    `RuntimeOptions.engine`, if any (with `onnxruntime`, an estimate by default: see the module's docstring)."""
    merged = runtime_settings(DEFAULTS, {}, overrides, where)  # the plan in the manifest is `plan.with_overrides`'
    off_device = engine == "onnxruntime"
    if engine is not None:
        if overrides.get("engine", engine) != engine:
            raise ConfigError(f"engine {engine!r} and orin setting engine = {overrides['engine']!r} disagree", where)
        merged["engine"] = engine
    engine = merged["engine"]
    if engine not in ENGINES:
        raise ConfigError(f"orin setting engine = {engine!r} (expected {' or '.join(ENGINES)})", where)
    if off_device and merged["estimate"] is None:  # billed, so every figure of the run states where it came from
        from .estimate import DEFAULT_DEVICE, DEFAULT_MODE

        merged["estimate"] = f"{DEFAULT_DEVICE}:{DEFAULT_MODE}"
    estimate = None if merged["estimate"] is None else parse_estimate(merged["estimate"], where)
    plan_overrides = {k: v for k, v in overrides.items() if k in OVERRIDABLE}
    if engine == "tensorrt" and estimate is not None:
        raise ConfigError(
            "an Orin estimate bills the graphs run in ONNX Runtime (set engine=onnxruntime too); TensorRT on the "
            "device is measured by the board's own meter",
            where,
        )
    trt_only = sorted(set(plan_overrides) - set(BOTH_ENGINES))
    if engine == "onnxruntime" and trt_only:
        raise ConfigError(
            f"{', '.join(trt_only)}: TensorRT build settings, which engine=onnxruntime would ignore",
            where,
        )
    return RunSettings(engine, estimate, plan_overrides)
