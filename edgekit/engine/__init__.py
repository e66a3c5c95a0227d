"""The token engine: continuous batching over any target's run side (see `scheduler`)."""

from .control import CONTROLLERS, BandwidthRule, BatchController, FixedBatch, LatencyTarget, StepStats, make_controller
from .request import Cancelled, EngineBusyError, KVBudgetError, Request, Ticket
from .scheduler import Engine, generate_all
from .slots import PastKVSlots, SlotBackend, as_slots

__all__ = [
    "CONTROLLERS",
    "BandwidthRule",
    "BatchController",
    "Cancelled",
    "Engine",
    "EngineBusyError",
    "FixedBatch",
    "KVBudgetError",
    "LatencyTarget",
    "PastKVSlots",
    "Request",
    "SlotBackend",
    "StepStats",
    "Ticket",
    "as_slots",
    "generate_all",
    "make_controller",
]
