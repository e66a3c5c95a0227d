"""Energy-quality-latency profiles of a model's variants: measured points and their Pareto front."""

from edgekit.pareto.profile import Point, Profile, dominates, non_dominated, read_profile, write_profile

__all__ = ["Point", "Profile", "dominates", "non_dominated", "read_profile", "write_profile"]
