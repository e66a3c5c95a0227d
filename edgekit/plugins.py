"""The plug-in registries: deployment targets and model families, each named once, by module path.

Why strings and not imports: the core (build, reporter, passes) must run any target and any model family without
importing one. A target package exports `TARGET` (see `edgekit.target.Target`: a build side and a run side); a
model family package exports `FAMILY` (see `edgekit.target.ModelFamily`: weights, recipes, calibration studies).
Adding a target is its package plus one line in `TARGETS`; nothing else in the core changes.
"""

from __future__ import annotations

import importlib
from typing import Any

from edgekit.errors import ConfigError

TARGETS: dict[str, str] = {
    "cpu": "edgekit.targets.cpu",
    "orin": "edgekit.targets.orin",
    "x1": "edgekit.targets.x1",
}
MODEL_FAMILIES: dict[str, str] = {
    "radreport-tiny": "edgekit.models.radreport_tiny",
}
DEFAULT_MODEL = "radreport-tiny"

_loaded: dict[tuple[str, str], Any] = {}


def _load(kind: str, table: dict[str, str], attr: str, name: str):
    key = (kind, name)
    if key not in _loaded:
        if name not in table:
            raise ConfigError(f"unknown {kind} '{name}' (known: {', '.join(sorted(table))})")
        value = table[name]
        _loaded[key] = getattr(importlib.import_module(value), attr) if isinstance(value, str) else value
    return _loaded[key]


def target_names() -> tuple[str, ...]:
    return tuple(sorted(TARGETS))


def get_target(name: str):
    """The `Target` plug-in called `name`."""
    return _load("target", TARGETS, "TARGET", name)


def get_model_family(name: str = DEFAULT_MODEL):
    """The `ModelFamily` plug-in called `name` (default: the embedded radreport-tiny)."""
    return _load("model family", MODEL_FAMILIES, "FAMILY", name)


def register_target(name: str, target) -> None:
    """Add a target at run time (an object or a module path): for out-of-tree targets and tests."""
    TARGETS[name] = target
    _loaded.pop(("target", name), None)


def _runnable_target(bundle):
    if bundle.target not in TARGETS:
        raise ConfigError(
            f"this bundle is for target '{bundle.target}', which cannot run here "
            f"(runnable: {', '.join(target_names())})",
            bundle.source,
        )
    return get_target(bundle.target)


def resolve_engine(bundle, engine: str | None = None) -> str | None:
    """The engine that runs `bundle`: `engine` when its target has it (`Target.engines`), else one line naming the
    ones it has; None asks for the target's own (its first engine; None when the plug-in names none)."""
    target = _runnable_target(bundle)
    engines = tuple(getattr(target, "engines", ()))
    if engine is None:
        return engines[0] if engines else None
    if engine not in engines:
        has = f"its engine{'s' if len(engines) > 1 else ''}: {', '.join(engines)}" if engines else "it names none"
        raise ConfigError(f"`engine={engine}` does not run {bundle.target} bundles ({has})", bundle.source)
    return engine


def load_backend(bundle, options=None):
    """The generation backend of `bundle`, from its target's run side (`options`: an `edgekit.target.
    RuntimeOptions`; default: the bundle's own runtime settings, physical-core threads, the target's own engine)."""
    from edgekit.target import RuntimeOptions

    options = options if options is not None else RuntimeOptions()
    resolve_engine(bundle, options.engine)  # an engine the target does not have: one line, before anything loads
    return _runnable_target(bundle).load_backend(bundle, options)
