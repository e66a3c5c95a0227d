"""Energy-quality-latency profiles of a model's variants: measured points and their Pareto fronts, one per device."""

from edgekit.pareto.profile import (
    Front,
    Point,
    Profile,
    dominates,
    front_key,
    non_dominated,
    read_profile,
    split_fronts,
    write_profile,
)

__all__ = [
    "Front",
    "Point",
    "Profile",
    "dominates",
    "front_key",
    "non_dominated",
    "read_profile",
    "split_fronts",
    "write_profile",
]
