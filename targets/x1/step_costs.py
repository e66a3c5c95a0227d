"""Per-instruction cost entries for the emulator, through the analytic cost model's formulas.

Why the analytic formulas (`costmodel.CostBuilder`): fed with the shapes and KV state the emulator really
sees, they make the emulated and the analytic figures agree by construction. Why memoised: an instruction's
cost depends only on static shapes, the head mask and the KV length, so each distinct key is built once.
"""

from __future__ import annotations

import numpy as np

from .costmodel import CostBuilder, KvPlacement, OpCost, Workload
from .machine import Machine


class Entry:
    """One instruction's finished cost at one static shape: what a record and the running totals need."""

    __slots__ = ("cost", "cycles", "compute", "memory", "bound", "energy", "e_sum", "key")

    def __init__(self, cost: OpCost, machine: Machine, hz: float, key: tuple = ()):
        self.cost = cost
        self.key = key  # what `Costs` built it from (a batched step rebuilds a GEMM's entry at its rows)
        self.compute = cost.compute_s * hz
        self.memory = cost.memory_s * hz
        self.cycles = max(self.compute, self.memory) + cost.overhead_s * hz
        self.bound = cost.bound
        energy = {a: n * machine.energy[a].pj for a, n in cost.counts.items() if n}
        energy["static"] = machine.power.static_w * self.cycles / hz * 1e12
        self.energy = energy
        self.e_sum = sum(energy.values())


class Costs:
    """Cost entries through the analytic model's formulas, memoised by what they depend on."""

    def __init__(self, machine: Machine):
        self.machine, self.hz = machine, machine.hz
        self.builders = {d: CostBuilder(machine, Workload(weights=d)) for d in ("int4", "int8", "fp16")}
        self.cache: dict[tuple, Entry] = {}

    def _get(self, key, make) -> Entry:
        e = self.cache.get(key)
        if e is None:
            e = self.cache[key] = Entry(make(), self.machine, self.hz, key)
        return e

    def vector(self, kind, layer, elements, ops, extra=None) -> Entry:
        def make():
            b = self.builders["int4"]
            b.vector(kind, kind, layer, float(elements), float(ops), extra)
            return b.ops.pop()

        return self._get(("v", kind, layer, elements, ops, tuple(sorted((extra or {}).items()))), make)

    def gemm(self, dtype, weight, layer, rows, kk, nn) -> Entry:
        def make():
            b = self.builders[dtype]
            b.matmul(weight, "gemm", layer, kk, nn, 0.0, rows=rows)
            return b.ops.pop()

        return self._get(("g", weight, rows, kk, nn), make)

    def act_matmul(self, layer, size, shape_a, shape_b) -> Entry:
        """Activation x activation (vision attention): attention-engine MACs."""
        m = self.machine
        macs = float(np.prod(shape_a)) * shape_b[-1]

        def make():
            b = self.builders["fp16"]
            b.vector("matmul", "matmul", layer, size, 1.0, {"mac_fp16": macs})
            c = b.ops.pop()
            c.compute_s = macs / (m.sram.kv_banks * m.attention.macs_per_kv_bank) / self.hz
            return c

        return self._get(("mm", layer, shape_a, shape_b), make)

    def attention(self, kind, layer, heads_active, groups_active, t, rows, head_dim, bytes_per_token, window) -> Entry:
        m = self.machine

        def make():
            b = self.builders["int4"]
            avg = max(1, int(round(t - (rows - 1) / 2)))  # causal: query rows see on average this many keys
            b.attention_matmul(
                kind, kind, layer, heads_active, groups_active, head_dim, KvPlacement(bytes_per_token, window, avg, 0)
            )
            c = b.ops.pop()
            if rows > 1:
                c.counts = {a: n * rows for a, n in c.counts.items()}
                c.compute_s *= rows
                c.memory_s *= rows
                c.energy_j = sum(n * m.energy[a].pj for a, n in c.counts.items()) * 1e-12
            return c

        return self._get(("att", kind, layer, heads_active, groups_active, t, rows), make)
