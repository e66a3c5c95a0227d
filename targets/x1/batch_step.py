"""The cost of one batched decode step on the X1: every row's next token through the decoder program at once.

Why per-row runs costed as one step: the numerics must be each row's own (its KV cache, its DSS head mask, so
its tokens are those it makes alone), and the emulator's cache holds one length per layer, so each row runs the
decoder by itself. The machine would not: it executes one program over all rows, and that is where batching
pays on a bandwidth-bound NPU. So the rows' runs are merged here, instruction by instruction, into the step the
machine executes (docs/x1/batching.md):

- a weight GEMM (`XL_GEMM.*`) runs once over all the rows' token rows: the machine model's own formula at that
  row count (`Costs.gemm`), so its weights stream once and `ceil(rows / matrix.rows)` passes of the MAC lanes
  apply them. Under DSS the Q columns and O rows of a head are streamed when any row computes the head (the union
  of the rows' masks), and computed for every row (a row that skipped the head discards them);
- every other instruction (norms, RoPE, KV append and eviction, spilled-KV loads, attention over the row's own
  cache, softmax) is one dispatch over all rows: each row's work back to back, `max(compute, memory)` of each,
  plus one `op_overhead_cycles`; its dynamic energy is each row's own, its static energy that of its time;
- the queues (LOAD ahead of COMPUTE, STORE beside it) are clocked over the merged instructions as the emulator
  clocks one run (`Emulator._run`).

Attribution: a GEMM's time and energy go to its rows by their share of its token rows (evenly in decode); a
merged instruction's to each row by its own work (dynamic energy and cycles) and one n-th of the dispatch. The
step's seconds and energy are then split in proportion to those sums, so the rows' parts add up to the step.
With one row every instruction is that row's own entry and the step is exactly its run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .prepared import MODE_COMPUTE, MODE_COMPUTE_AFTER_LOAD, MODE_COMPUTE_AFTER_STORE, MODE_LOAD_QUEUE, Prepared
from .run_result import RunResult

if TYPE_CHECKING:
    from .emulator import Emulator

WEIGHT_ACTIONS = ("near_memory_read_bit", "dram_read_bit")  # a GEMM's weight stream
OFF_CHIP_ACTIONS = ("near_memory_read_bit", "dram_read_bit", "dram_write_bit")  # what the bandwidth rule counts
_DTYPE_OF_BITS = {16: "fp16", 8: "int8", 4: "int4"}


@dataclass(frozen=True)
class StepCost:
    """One batched step: the machine's time and energy for all rows, and each row's attributed part."""

    rows: int
    cycles: float
    seconds: float
    energy_j: float
    off_chip_bytes: float  # weight stream + external DRAM, read and written
    weight_energy_j: float  # the weight stream's energy, shared by all rows
    row_cycles: tuple[float, ...]
    row_seconds: tuple[float, ...]
    row_energy_j: tuple[float, ...]


def step_cost(emu: Emulator, graph: str, runs: Sequence[RunResult], masks: Sequence[np.ndarray | None]) -> StepCost:
    """The step in which `runs` (one per row, of program `graph`) execute together; `masks[i]` is the head mask
    row i ran with (None: dense)."""
    prep = emu.prepared[graph]
    n = len(runs)
    per_row = [{st: e for st, _, e in r.entries} for r in runs]
    union = _union_masks(masks, emu.layers, emu.heads)
    hz, static_w = emu.hz, emu.machine.power.static_w
    pj = {a: emu.machine.energy[a].pj for a in WEIGHT_ACTIONS}
    ops = []  # (step, cycles, energy pJ) in program order: what the queues are clocked over
    raw_c, raw_e = [0.0] * n, [0.0] * n
    off_chip_bits = weight_pj = 0.0
    for st in prep.steps:
        present = [(i, rows[st]) for i, rows in enumerate(per_row) if st in rows]
        if not present:
            continue
        if len(present) == 1:  # one row's instruction: its own entry, exactly
            i, e = present[0]
            ops.append((st, e.cycles, e.e_sum))
            raw_c[i] += e.cycles
            raw_e[i] += e.e_sum
            counts = e.cost.counts
            if _is_gemm(prep, st):
                weight_pj += sum(counts.get(a, 0.0) * pj[a] for a in WEIGHT_ACTIONS)
        elif _is_gemm(prep, st):
            e, token_rows = _batched_gemm(emu, prep, st, present, union)
            ops.append((st, e.cycles, e.e_sum))
            counts = e.cost.counts
            weight_pj += sum(counts.get(a, 0.0) * pj[a] for a in WEIGHT_ACTIONS)
            total_rows = sum(token_rows)
            for (i, _), r in zip(present, token_rows):
                raw_c[i] += e.cycles * r / total_rows
                raw_e[i] += e.e_sum * r / total_rows
        else:
            work = [max(e.compute, e.memory) for _, e in present]
            overhead = max(e.cycles - w for (_, e), w in zip(present, work))
            cycles = sum(work) + overhead
            dynamic = [e.e_sum - e.energy.get("static", 0.0) for _, e in present]
            ops.append((st, cycles, sum(dynamic) + static_w * cycles / hz * 1e12))
            for (i, _), w, d in zip(present, work, dynamic):
                own = w + overhead / len(present)
                raw_c[i] += own
                raw_e[i] += d + static_w * own / hz * 1e12
            counts = {}
            for _, e in present:
                for a in OFF_CHIP_ACTIONS:
                    counts[a] = counts.get(a, 0.0) + e.cost.counts.get(a, 0.0)
        off_chip_bits += sum(counts.get(a, 0.0) for a in OFF_CHIP_ACTIONS)
    cycles, energy_pj = _clock(ops)
    seconds, energy_j = cycles / hz, energy_pj * 1e-12
    sum_c, sum_e = sum(raw_c), sum(raw_e)
    return StepCost(
        rows=n,
        cycles=cycles,
        seconds=seconds,
        energy_j=energy_j,
        off_chip_bytes=off_chip_bits / 8,
        weight_energy_j=weight_pj * 1e-12,
        row_cycles=tuple(cycles * (c / sum_c) if sum_c else 0.0 for c in raw_c),
        row_seconds=tuple(seconds * (c / sum_c) if sum_c else 0.0 for c in raw_c),
        row_energy_j=tuple(energy_j * (e / sum_e) if sum_e else 0.0 for e in raw_e),
    )


def _attr(prep: Prepared, st) -> dict:
    program = prep.program
    return program.attrs[program.instructions[st.index].operands[0]]


def _is_gemm(prep: Prepared, st) -> bool:
    return st.mnemonic.startswith("XL_GEMM") and "op" not in _attr(prep, st)


def _batched_gemm(emu: Emulator, prep: Prepared, st, present, union):
    """The GEMM over all present rows' token rows, at the union of their active heads (`bind_matrix.gemm`'s own
    shrinking of Q's N and O's K); and each row's token rows."""
    attr = _attr(prep, st)
    layer = attr.get("layer")
    role = attr.get("head_role") if emu.head_dim else None
    frac = 1.0
    if role is not None and union is not None and layer is not None:
        frac = float(union[layer].mean())
    k, n = attr["k"], attr["n"]
    kk, nn = (k * frac, n) if role == "o_proj" else (k, n * frac if role == "q_proj" else n)
    token_rows = [e.key[2] for _, e in present]  # `Costs.gemm`'s key: ("g", weight, rows, k, n)
    e = emu.costs.gemm(_DTYPE_OF_BITS[attr["bits"]], attr["weight"], layer, sum(token_rows), kk, nn)
    return e, token_rows


def _union_masks(masks: Sequence[np.ndarray | None], layers: int, heads: int) -> np.ndarray | None:
    """Heads any row computes (a dense row computes all); None when every row ran dense."""
    if all(m is None for m in masks):
        return None
    dense = np.ones((layers, heads), bool)
    return np.any([dense if m is None else np.asarray(m, bool) for m in masks], axis=0)


def _clock(ops) -> tuple[float, float]:
    """Cycles and energy (pJ) of instructions in program order, queued as `Emulator._run` queues one run: LOAD
    runs ahead from the start, COMPUTE in order (waiting for its layer's load or the last store where it must),
    STORE beside COMPUTE."""
    c0 = c1 = c2 = 0.0
    load_ready: dict = {}
    store_ready = 0.0
    energies = []
    for st, cyc, e_sum in ops:
        mode = st.mode
        if mode == MODE_COMPUTE:
            c1 = c1 + cyc
        elif mode == MODE_COMPUTE_AFTER_LOAD:
            c1 = max(c1, load_ready.get(st.layer, 0.0)) + cyc
        elif mode == MODE_COMPUTE_AFTER_STORE:
            c1 = max(c1, store_ready) + cyc
        elif mode == MODE_LOAD_QUEUE:
            c0 = c0 + cyc
            load_ready[st.layer] = c0
        else:
            c2 = max(c2, c1) + cyc
            store_ready = c2
        energies.append(e_sum)
    return max(c0, c1, c2), sum(energies)
