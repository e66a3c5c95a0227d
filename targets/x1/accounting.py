"""What one sequence cost on the emulated X1, by phase, and the cost dict a report carries.

Why its own module: a sequence's cost is no longer always the sum of its own emulator runs. A decode step that
several rows share is executed once (weights streamed once for all of them) and its time and energy are
attributed to the rows (`batch_step`); the row then adds its share here, and the whole step's time to what it
waited (`waited_s`), since its next token came only when the whole step was done. Alone, a row's share is the
whole step and it waited nothing more, so the figures are exactly those of its own runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .batch_step import StepCost
from .run_result import RunResult


@dataclass
class PhaseCost:
    calls: int = 0
    cycles: float = 0.0
    seconds: float = 0.0
    energy_j: float = 0.0

    def add(self, cycles: float, seconds: float, energy_j: float) -> None:
        self.calls += 1
        self.cycles += cycles
        self.seconds += seconds
        self.energy_j += energy_j


@dataclass
class SequenceCost:
    """One sequence's attributed cost by phase (encode, embed, prefill, decode); a decoded token costs its
    decoder step plus its embedding lookup (the prefill's token costs the prefill). `waited_s`: emulated time the
    sequence spent in shared steps beyond its own share (0 alone); `decode_rows`: rows summed over its decode
    steps (its mean batch is `decode_rows / decode steps`)."""

    phases: dict[str, PhaseCost] = field(default_factory=dict)
    decode_embed: PhaseCost = field(default_factory=PhaseCost)  # embedding lookups of decoded tokens
    waited_s: float = 0.0
    decode_rows: int = 0

    def add(self, phase: str, cycles: float, seconds: float, energy_j: float, *, decoding: bool = False) -> None:
        self.phases.setdefault(phase, PhaseCost()).add(cycles, seconds, energy_j)
        if decoding and phase == "embed":
            self.decode_embed.add(cycles, seconds, energy_j)

    def add_run(self, phase: str, r: RunResult, *, share: float = 1.0, decoding: bool = False) -> None:
        """`share` of run `r` (a run several rows made together: each row's part of it)."""
        t = r.totals
        cycles, seconds, energy = float(t["cycles"]), float(t["seconds"]), float(t["energy_j"])
        if share != 1.0:
            self.waited_s += seconds * (1.0 - share)
            cycles, seconds, energy = cycles * share, seconds * share, energy * share
        self.add(phase, cycles, seconds, energy, decoding=decoding)

    def add_step(self, phase: str, step: StepCost, i: int) -> None:
        """Row `i`'s part of a step the rows made together; it waited for the whole step."""
        seconds = step.row_seconds[i]
        self.add(phase, step.row_cycles[i], seconds, step.row_energy_j[i])
        self.waited_s += step.seconds - seconds
        if phase == "decode":
            self.decode_rows += step.rows

    def summary(self) -> dict:
        """The figures every x1 cost dict states (`X1Backend.take_cost`, `release`)."""
        phases = self.phases
        decode = phases.get("decode", PhaseCost())
        steps = decode.calls
        total_s = sum(p.seconds for p in phases.values())
        total_j = sum(p.energy_j for p in phases.values())
        return {
            "decode_steps": steps,
            "emulated_ms_per_token": (decode.seconds + self.decode_embed.seconds) / steps * 1e3 if steps else 0.0,
            "mj_per_token": (decode.energy_j + self.decode_embed.energy_j) / steps * 1e3 if steps else 0.0,
            "emulated_ms_total": total_s * 1e3,
            "mj_total": total_j * 1e3,
            # what the reporter bills: the device's own latency (the whole of every shared step this sequence
            # waited for) and energy (its share), not the host's running the emulator
            "latency_ms": (total_s + self.waited_s) * 1e3,
            "energy_j": total_j,
            "decode_batch_mean": self.decode_rows / steps if steps else 1.0,  # no decode step: alone (as the engine)
            "phases": {k: {"calls": v.calls, "ms": v.seconds * 1e3, "mj": v.energy_j * 1e3} for k, v in phases.items()},
        }
