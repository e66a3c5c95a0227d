"""What binding a program needs from the emulator that runs it: the machine, its cost tables and the decoder's
attention shape. A small value, so that `binder`, `prepared` and the `bind_*` modules never import the emulator
(which imports them)."""

from __future__ import annotations

from dataclasses import dataclass

from edgekit.errors import EdgekitError

from .machine import Machine
from .step_costs import Costs


class EmulatorError(EdgekitError):
    """Inputs a program cannot run on (missing feed, wrong shape or dtype), or an instruction it cannot run."""


@dataclass(frozen=True)
class BindEnv:
    machine: Machine
    costs: Costs
    heads: int  # query heads of the decoder's attention (0: no decoder program)
    kv_heads: int
    head_dim: int
    window: int  # KV positions the on-chip window holds (kvcache.kv_window)
    kv_bytes_per_token: float
