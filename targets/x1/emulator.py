"""The X1 emulator: runs compiled programs with numpy, the spec's integer numerics, and a cycle and energy model.

Why this shape: the functional work and the accounting are separated. At load time each instruction is bound
once to a small closure (`binder.Binder`) with its operand slots, prepared weights (INT4 codes unpacked, FP16
scales widened) and attributes resolved, so a run is a tight loop over closures on whole tensors with no per-call
decoding. An instruction's cost depends only on static shapes, the head mask and (attention, KV) the cache
length, so each closure keeps its own small table of finished cost entries (`step_costs.Entry`: cycles, bound,
energy per action and their sum) keyed by exactly those; per call only the queue clocks and running energy
totals are updated. Per-instruction records (`InstrRecord`) are built only when `RunResult.records` is read (traces,
profiles): reports never pay for them.

Timing and energy reuse the analytic cost model's per-op formulas (`costmodel.CostBuilder`), fed with the shapes
and the KV state the emulator really sees, so the analytic and the emulated figures agree by construction. Queues:
LOAD (KVLD) runs ahead of COMPUTE from the start of a call, STORE (KVEVICT) runs beside it; an instruction that
needs their data waits (dependency token).

Storage simplification (documented in docs/x1 terms): tensors live in a table indexed by the memory plan's
tensor id (the plan gives each its ACT byte range); vector intermediates are kept in FP32, GEMM outputs are
rounded to FP16 as numerics.md says, the KV cache is INT4 + FP16 group scales in a resident window plus a spilled
DRAM region (kv-spill.md), with attention always over the whole context. The cache's rows live in growable
buffers in the form attention reads them (`kvcache`), so a token appends its own rows and converts nothing else.

Steps whose outputs depend only on the call's integer inputs and input shapes (the causal mask and the RoPE
tables) are memoised per program by those values (`prepared.Prepared.memo`): a call that repeats a key (the same
positions in the next report) replays their outputs and cost entries, in program order, so figures are unchanged.
Every shortcut here computes the same IEEE operations on the same values as the plain formulas; the tests pin
the emulated totals and compare kernels bit for bit.

This module is the run loop (queue clocks, energy sums, overrides); the pieces live beside it: `kvcache`,
`step_costs`, `prepared` (binding and memo), `binder` and `bind_*` (what each instruction does), `onnx_ops`,
`run_result`, `blas_threads`.
"""

from __future__ import annotations

import time

import numpy as np

from edgekit.names import DECODER_ROLE, PAST_PREFIX, past_key, past_value

from .bind_env import BindEnv, EmulatorError
from .blas_threads import blas_limiter
from .kvcache import KVCache, kv_window
from .machine import Machine
from .prepared import MODE_COMPUTE, MODE_COMPUTE_AFTER_LOAD, MODE_COMPUTE_AFTER_STORE, MODE_LOAD_QUEUE, Prepared, Step
from .program import Program
from .run_result import InstrRecord, RunResult
from .step_costs import Costs

__all__ = ["Emulator", "EmulatorError", "InstrRecord", "KVCache", "RunResult", "kv_window"]


class Emulator:
    """Runs the programs of one model: `run(graph, feeds, head_mask=..., capture=..., overrides=...)`."""

    def __init__(self, programs: dict[str, Program], machine: Machine, *, blas_threads: int | None = 1):
        for name, p in programs.items():
            if p.machine_hash != machine.hash:
                raise EmulatorError(
                    f"program '{name}' was compiled for machine {p.machine_hash[:16]}, not "
                    f"'{machine.machine.name}' ({machine.short_hash})"
                )
        self.machine = machine
        self.programs = programs
        self.costs = Costs(machine)
        self._blas = blas_limiter(blas_threads)
        self.kv_group = machine.numerics.kv_group_size
        self.hz = machine.hz
        self.overhead = machine.queues.op_overhead_cycles
        dec = programs.get(DECODER_ROLE)
        self.layers = len(dec.io.get("kv_outputs", {})) if dec else 0
        self.kv_heads = self.head_dim = self.heads = 0
        self.window, self.kv_bytes_per_token = 0, 0.0
        if dec:
            shape = next(i["shape"] for i in dec.io["inputs"] if i["name"] == past_key(0))
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
            for ins in dec.instructions:
                if ins.mnemonic in ("XL_GEMM.W4A8", "XL_GEMM.F16", "XL_GEMM.W8A8"):
                    attr = dec.attrs[ins.operands[0]]
                    if attr.get("head_role") == "q_proj":
                        self.heads = attr["n"] // self.head_dim
                        break
            self.window, self.kv_bytes_per_token = kv_window(machine, self.layers, self.kv_heads, self.head_dim)
        env = BindEnv(
            machine, self.costs, self.heads, self.kv_heads, self.head_dim, self.window, self.kv_bytes_per_token
        )
        self.prepared = {name: Prepared(name, p, env) for name, p in programs.items()}

    # ---------------------------------------------------------------------------------------------------------
    def new_kv(self) -> KVCache:
        return KVCache(self.layers, self.window, min(self.kv_group, self.head_dim))

    def run(
        self,
        graph: str,
        feeds: dict[str, np.ndarray],
        *,
        head_mask: np.ndarray | None = None,
        capture: set[str] | None = None,
        kv_state: KVCache | None = None,
        want_present: bool = True,
        overrides: dict[str, np.ndarray] | None = None,
    ) -> RunResult:
        """Execute one program. `overrides` maps ONNX value names to arrays that replace the emulator's own value
        when the instruction producing it has run (cast to the dtype and shape the emulator holds it in), before
        any consumer reads it: per-layer accuracy analysis feeds reference inputs this way. Values the program
        does not materialise (fused away) or holds quantised are not substituted; `RunResult.overridden` lists
        those that were."""
        if graph not in self.prepared:
            raise EmulatorError(f"no program for graph '{graph}' (have: {', '.join(self.prepared)})")
        if self._blas is None or not self.prepared[graph].uses_blas:
            return self._run(graph, feeds, head_mask, capture, kv_state, want_present, overrides)
        prev = self._blas.__enter__()
        try:
            return self._run(graph, feeds, head_mask, capture, kv_state, want_present, overrides)
        finally:
            self._blas.restore(prev)

    def _run(self, graph, feeds, head_mask, capture, kv_state, want_present, overrides) -> RunResult:
        t0 = time.perf_counter()
        prep = self.prepared[graph]
        store = self._input_store(graph, prep, feeds, kv_state)
        kv = self._call_kv(prep, feeds, kv_state)
        ctx = _RunContext(self, kv, self._head_mask(head_mask), bool(prep.kv_outputs))
        ids = prep.ids
        by_id = {ids[n]: np.asarray(v) for n, v in (overrides or {}).items() if n in ids}
        replaced: list[str] = []
        subst = _Substitution(by_id, {i: n for n, i in ids.items()}, replaced) if by_id else None
        # input-determined steps: replayed from the memo when this key was seen (not while values are being
        # captured or overridden: those runs must see, and may change, freshly computed arrays)
        key: tuple | None = None
        replay: list | None = None
        recorded: list | None = None  # a memo miss: the steps' cost entries, remembered under `key`
        if prep.static_steps and not by_id and not capture:
            key = prep.memo_key(store)
            replay = self._replay(prep, key, store)
            recorded = [] if replay is None else None
        cycles, energies, log = _execute(prep.plan, store, ctx, replay, recorded, subst)
        if key is not None and recorded is not None:
            prep.remember(key, store, recorded)
        outputs = self._outputs(prep, store, kv, want_present)
        captured = {n: store[ids[n]] for n in (capture or ()) if n in ids and store[ids[n]] is not None}
        totals = {
            "cycles": cycles,
            "seconds": cycles / self.hz,
            "energy_j": sum(energies) * 1e-12,
            "instructions": len(log),
            "host_partitions_s": ctx.host_s,
        }
        return RunResult(
            outputs,
            captured,
            totals,
            kv,
            ctx.head_norms if prep.kv_outputs else None,
            ctx.host_s,
            time.perf_counter() - t0,
            log=log,
            overridden=replaced,
        )

    @staticmethod
    def _input_store(graph: str, prep: Prepared, feeds: dict, kv_state: KVCache | None) -> list:
        """The call's tensor table: the program's constants, then the fed inputs (past KV comes from `kv_state`
        when there is one)."""
        store = list(prep.base_store)
        ids = prep.ids
        for name in prep.inputs:
            if name.startswith(PAST_PREFIX) and kv_state is not None:
                continue
            if name not in feeds:
                raise EmulatorError(f"graph '{graph}': missing input '{name}'")
            if name in ids:
                store[ids[name]] = np.asarray(feeds[name])
        return store

    def _call_kv(self, prep: Prepared, feeds: dict, kv_state: KVCache | None) -> KVCache | None:
        """The cache this call appends to: a copy of `kv_state`, or one built from the fed past arrays."""
        if not prep.kv_outputs:
            return None
        if kv_state is not None:
            return kv_state.copy()
        past = [(feeds[past_key(i)], feeds[past_value(i)]) for i in range(self.layers)]
        return KVCache.from_arrays(past, self.window, min(self.kv_group, self.head_dim))

    def _head_mask(self, head_mask: np.ndarray | None) -> np.ndarray | None:
        mask = None if head_mask is None else np.asarray(head_mask, bool)
        if mask is not None and mask.shape != (self.layers, self.heads):
            raise EmulatorError(f"head_mask has shape {mask.shape}, expected ({self.layers}, {self.heads})")
        return mask

    @staticmethod
    def _replay(prep: Prepared, key, store: list) -> list | None:
        """On a memo hit: the remembered outputs written into `store`, and their cost entries (None on a miss)."""
        hit = prep.memo.get(key)
        if hit is None:
            return None
        outs, replay = hit
        for i, a in outs:
            store[i] = a
        return replay

    @staticmethod
    def _outputs(prep: Prepared, store: list, kv: KVCache | None, want_present: bool) -> dict:
        ids = prep.ids
        outputs = {}
        for name in prep.outputs:
            if name in ids and store[ids[name]] is not None:
                outputs[name] = store[ids[name]]
        if kv is not None and want_present:
            for layer, (kname, vname) in prep.kv_outputs.items():
                outputs[kname], outputs[vname] = kv.dequantized(layer)
        return outputs


class _Substitution:
    """A call's overrides (`Emulator.run(overrides=...)`) by tensor id, and the names it replaced."""

    __slots__ = ("by_id", "names", "replaced")

    def __init__(self, by_id: dict, names: dict, replaced: list):
        self.by_id, self.names, self.replaced = by_id, names, replaced

    def apply(self, st: Step, store: list) -> None:
        by_id = self.by_id
        for tid in st.out_ids:
            if tid in by_id and isinstance(store[tid], np.ndarray):
                cur = store[tid]
                store[tid] = by_id[tid].astype(cur.dtype).reshape(cur.shape)
                self.replaced.append(self.names[tid])


def _execute(plan, store: list, ctx, replay: list | None, recorded: list | None, subst: _Substitution | None):
    """The hot loop: every step of `plan` in order on the queue clocks (LOAD, COMPUTE, STORE). Returns the
    call's cycles, the steps' energies (pJ) and the log of (step, start cycle, cost entry).

    Steps with `si >= 0` are input-determined: their cost entries come from `replay` on a memo hit (their
    outputs are already in `store`), else they run and their entries are appended to `recorded`. Kept as one
    flat loop over locals: a helper call per step would cost more than many of the steps themselves."""
    log: list = []
    energies: list[float] = []
    c0 = c1 = c2 = 0.0
    load_ready: dict = {}
    store_ready = 0.0
    for fn, si, mode, st in plan:
        if si < 0:
            e = fn(store, ctx)
        elif replay is not None:
            e = replay[si]
        else:
            e = fn(store, ctx)
            if recorded is not None:
                recorded.append(e)
        if subst is not None:
            subst.apply(st, store)
        if e is None:
            continue
        cyc = e.cycles
        if mode == MODE_COMPUTE:
            start = c1
            c1 = start + cyc
        elif mode == MODE_COMPUTE_AFTER_LOAD:
            start = max(c1, load_ready.get(st.layer, 0.0))
            c1 = start + cyc
        elif mode == MODE_COMPUTE_AFTER_STORE:
            start = max(c1, store_ready)
            c1 = start + cyc
        elif mode == MODE_LOAD_QUEUE:
            start = c0  # the LOAD queue runs ahead: spilled rows do not depend on this token's compute
            c0 = start + cyc
            load_ready[st.layer] = c0
        else:
            start = max(c2, c1)
            c2 = start + cyc
            store_ready = c2
        energies.append(e.e_sum)
        log.append((st, start, e))
    return max(c0, c1, c2), energies, log


class _RunContext:
    """Per-call state: the KV cache, the head mask (and what follows from it per layer), attention statistics."""

    __slots__ = (
        "kv",
        "mask",
        "frac",
        "col_mask",
        "_groups",
        "attn_out",
        "ctx_len",
        "host_s",
        "kv_heads",
        "_norm_shape",
        "fp16_inputs",
    )

    def __init__(self, emu: Emulator, kv: KVCache | None, mask: np.ndarray | None, attention: bool = True):
        self.kv, self.mask = kv, mask
        self.kv_heads = emu.kv_heads
        self._norm_shape = (emu.layers, emu.heads) if emu.layers and attention else None
        self.attn_out: list[tuple] = []  # (layer, last query row of batch item 0 (kv, group, hd), head mask row)
        self.fp16_inputs: dict = {}  # F16 GEMM operands shared by several GEMMs: id -> (array, FP16 copy)
        self.ctx_len: dict[int, tuple[int, int]] = {}
        self.host_s = 0.0
        self.frac: list[float] = []
        self.col_mask: list[np.ndarray] = []
        self._groups: list[int] = []
        if mask is not None:
            self.frac = [float(m.mean()) for m in mask]
            self.col_mask = [np.repeat(m, emu.head_dim).astype(np.float32) for m in mask]
            self._groups = [int(m.reshape(emu.kv_heads, -1).any(1).sum()) for m in mask]

    @property
    def head_norms(self):
        """A builder for `RunResult.head_norms` (None for graphs without attention)."""
        if self._norm_shape is None:
            return None
        shape, rows = self._norm_shape, self.attn_out

        def build() -> np.ndarray:
            norms_all = np.full(shape, np.nan, np.float32)
            for layer, last, act in rows:
                norms = np.sqrt(np.add.reduce(last * last, axis=-1)).reshape(-1)  # np.linalg.norm's own formula
                norms_all[layer] = norms if act is None else np.where(act, norms, np.nan)
            return norms_all

        return build

    def frac_or_one(self, layer) -> float:
        return 1.0 if self.mask is None or layer is None else self.frac[layer]

    def groups_active(self, layer) -> int:
        return self.kv_heads if self.mask is None or layer is None else self._groups[layer]
