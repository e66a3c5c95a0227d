"""The meter `edgekit pareto` bills non-emulated reports with: the best this machine has (measured, else
estimated), or the one named with `--meter` (by its source label or its kind)."""

from __future__ import annotations

from edgekit.errors import ConfigError


def _meters(name: str | None):
    from edgekit.energy.discover import discover_meters

    meters = list(discover_meters("/"))
    if name is None or name == "auto":
        return meters
    chosen = [m for m in meters if m.source == name or m.source.startswith(name.rstrip(":") + ":")]
    if not chosen:
        known = ", ".join(m.source for m in meters) or "none"
        raise ConfigError(f"no meter {name!r} on this machine (found: {known})")
    return chosen + [m for m in meters if m not in chosen]  # the others stay as fallbacks


def describe_meter(name: str | None) -> dict:
    """What pareto.json records about the meter (`name`: the label the measuring processes open again)."""
    meters = _meters(name)
    if not meters:
        return {"name": None, "description": "none (reports carry no energy)", "meters": []}
    return {
        "name": meters[0].source,
        "description": meters[0].source + (f" (then {', '.join(m.source for m in meters[1:])})" if meters[1:] else ""),
        "meters": [m.describe() for m in meters],
    }


def open_meter(name: str):
    """A started sampler over the meter `name` and those after it (the fallback order discovery gave)."""
    from edgekit.energy.sampler import Sampler

    return Sampler(_meters(name)).start()
