"""What one emulator call returns: outputs, totals, the KV state after it, and records built only when read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .program import QUEUES

if TYPE_CHECKING:
    from .kvcache import KVCache


@dataclass
class InstrRecord:
    index: int
    mnemonic: str
    queue: str
    symbol: str
    layer: int | None
    start_cycle: float
    cycles: float
    compute_cycles: float
    memory_cycles: float
    bound: str
    energy_pj: dict[str, float]


class RunResult:
    """One emulator call: outputs, captured values, totals, the KV state after the call, and (built on first
    read) one `InstrRecord` per costed instruction."""

    def __init__(
        self,
        outputs: dict[str, np.ndarray],
        captured: dict[str, np.ndarray],
        totals: dict[str, float],
        kv_state: KVCache | None = None,
        head_norms: np.ndarray | None = None,
        host_seconds: float = 0.0,
        wall_seconds: float = 0.0,
        *,
        log: list | None = None,
        overridden: list[str] | None = None,
    ):
        self.outputs, self.captured, self.totals = outputs, captured, totals
        self.kv_state = kv_state
        self._head_norms = head_norms  # an array, or a callable building it on first read
        self.host_seconds, self.wall_seconds = host_seconds, wall_seconds
        self.overridden = overridden or []  # ONNX values replaced by `Emulator.run(overrides=...)`
        self._log = log or []
        self._records: list[InstrRecord] | None = None

    @property
    def head_norms(self) -> np.ndarray | None:
        """(layers, heads): L2 norm of each head's attention output for the last query row of batch item 0 (NaN:
        head skipped). Built on first read from the outputs the attention instructions left: a report that
        does not steer heads never pays for it."""
        h = self._head_norms
        if callable(h):
            h = self._head_norms = h()
        return h

    @property
    def entries(self) -> list:
        """(step, start cycle, cost entry) of every costed instruction, in program order: what `records` are
        built from, and what a batched step (`batch_step`) merges over rows."""
        return self._log

    @property
    def records(self) -> list[InstrRecord]:
        if self._records is None:
            self._records = [
                InstrRecord(
                    st.index,
                    st.mnemonic,
                    QUEUES[st.queue],
                    st.symbol,
                    st.layer,
                    start,
                    e.cycles,
                    e.compute,
                    e.memory,
                    e.bound,
                    dict(e.energy),
                )
                for st, start, e in self._log
            ]
        return self._records
