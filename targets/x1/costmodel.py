"""Analytic X1 cost model: latency and energy of one generated token from a decoder shape alone (no weights).

Why analytic: a user budgets a 7B model on the X1 before any weights are quantised, and the seed's headline
figures can only be checked this way. The model follows docs/x1/machine.md exactly as the emulator will:
- each op's compute time comes from MAC-lane or vector-lane rates, its memory time from the path its bytes take
  (near-memory weight stream, SRAM bank ports, external DRAM; paths run in parallel, so the slowest one counts);
- an op takes max(compute, memory) + a fixed dispatch overhead: the load, compute and store queues overlap
  tiles *within* an op; across ops the weight stream cannot run ahead (weights flow straight into the MAC lanes,
  there is no buffer for a whole next matrix), so ops add up;
- energy = action counts x the machine's energy table, plus static power x time;
- the KV cache lives in the KV banks; when it outgrows them, the newest `window` tokens of each layer stay in
  SRAM and older ones spill to DRAM (read every token, for every active KV group);
- dynamic head sparsity (DSS) removes a skipped head's Q projection columns, its O projection rows, its RoPE,
  and its attention (QK^T, softmax, PV and their K/V reads). K and V are still projected and appended for every
  KV head, because a later token may need a head this token skipped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from edgekit.decoder_shape import DecoderShape
from edgekit.errors import ConfigError
from edgekit.targets.x1.machine import Machine

WEIGHT_DTYPES = ("int4", "int8", "fp16")
_MAC_ACTION = {"int4": "mac_int4xint8", "int8": "mac_int8xint8", "fp16": "mac_fp16"}


@dataclass(frozen=True)
class Workload:
    """What is being generated: weight format, DSS target (fraction of heads skipped) and KV length."""

    weights: str = "int4"
    head_sparsity: float = 0.0
    context: int = 1024  # tokens in the KV cache while this token is generated, itself included

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_DTYPES:
            raise ConfigError(f"field 'weights' = {self.weights!r} (expected one of {', '.join(WEIGHT_DTYPES)})")
        if not (isinstance(self.head_sparsity, (int, float)) and 0.0 <= self.head_sparsity < 1.0):
            raise ConfigError(f"field 'head_sparsity' = {self.head_sparsity!r} (expected 0 <= s < 1)")
        if not isinstance(self.context, int) or isinstance(self.context, bool) or self.context < 1:
            raise ConfigError(f"field 'context' = {self.context!r} (expected a positive integer)")


@dataclass
class OpCost:
    """One op of one token: its action counts and the time and energy they cost."""

    name: str  # e.g. "layers.3.q_proj"
    kind: str  # e.g. "q_proj"
    layer: int | None
    unit: str  # "matrix" | "attention" | "vector"
    counts: dict[str, float] = field(default_factory=dict)  # action -> count (bits for memory actions)
    compute_s: float = 0.0
    memory_s: float = 0.0
    overhead_s: float = 0.0
    energy_j: float = 0.0

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """What sets the op's time: "memory", "compute", or "dispatch" when the fixed per-op overhead exceeds both."""
        if self.overhead_s > max(self.compute_s, self.memory_s):
            return "dispatch"
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(time_s=self.time_s, bound=self.bound)
        return d


@dataclass(frozen=True)
class KvPlacement:
    """How one layer's KV cache sits in the KV banks at this context length."""

    bytes_per_token: float  # per layer, K and V, scales included
    window: int  # tokens per layer the banks hold
    resident: int
    spilled: int


@dataclass
class TokenEstimate:
    shape: DecoderShape
    workload: Workload
    machine_name: str
    machine_hash: str
    ops: list[OpCost]
    kv: KvPlacement
    static_w: float
    weights_in_dram_bytes: float
    energy_by_action_j: dict[str, float]

    @property
    def time_s(self) -> float:
        return sum(op.time_s for op in self.ops)

    @property
    def energy_j(self) -> float:
        return sum(op.energy_j for op in self.ops)

    def bytes_moved(self, action: str) -> float:
        return sum(op.counts.get(action, 0.0) for op in self.ops) / 8

    def by_kind(self) -> list[dict]:
        """The per-layer-type table: each op kind summed over layers, with its share and bound type."""
        rows: dict[str, dict] = {}
        total_t, total_e = self.time_s, self.energy_j
        for op in self.ops:
            r = rows.setdefault(
                op.kind,
                {
                    "op": op.kind,
                    "unit": op.unit,
                    "count": 0,
                    "time_us": 0.0,
                    "energy_uj": 0.0,
                    "_bounds": defaultdict(float),
                },
            )
            r["count"] += 1
            r["time_us"] += op.time_s * 1e6
            r["energy_uj"] += op.energy_j * 1e6
            r["_bounds"][op.bound] += op.time_s
        out = []
        for r in rows.values():
            bounds = r.pop("_bounds")
            r["bound"] = max(bounds, key=bounds.get)
            r["time_pct"] = 100 * r["time_us"] / (total_t * 1e6)
            r["energy_pct"] = 100 * r["energy_uj"] / (total_e * 1e6)
            out.append(r)
        return out

    def per_layer(self) -> list[dict]:
        """Time, energy and the dominant bound type of each decoder layer (and the embedding/LM head as "head")."""
        layers: dict = {}
        for op in self.ops:
            key = op.layer if op.layer is not None else "head"
            r = layers.setdefault(key, {"layer": key, "time_us": 0.0, "energy_uj": 0.0, "_bounds": defaultdict(float)})
            r["time_us"] += op.time_s * 1e6
            r["energy_uj"] += op.energy_j * 1e6
            r["_bounds"][op.bound] += op.time_s
        for r in layers.values():
            bounds = r.pop("_bounds")
            r["bound"] = max(bounds, key=bounds.get)
        return list(layers.values())

    def totals(self) -> dict:
        t = self.time_s
        return {
            "ms_per_token": t * 1e3,
            "j_per_token": self.energy_j,
            "tokens_per_s": 1.0 / t,
            "avg_power_w": self.energy_j / t,
            "weight_bytes_per_token": self.bytes_moved("near_memory_read_bit") + self.weights_in_dram_bytes,
            "weights_from_dram_bytes": self.weights_in_dram_bytes,
            "kv_window_tokens": self.kv.window,
            "kv_spilled_tokens": self.kv.spilled,
            "memory_bound_pct": 100 * sum(o.time_s for o in self.ops if o.bound == "memory") / t,
        }

    def to_dict(self) -> dict:
        return {
            "model": self.shape.to_dict(),
            "workload": asdict(self.workload),
            "machine": {"name": self.machine_name, "hash": self.machine_hash},
            "totals": self.totals(),
            "energy_by_action_j": self.energy_by_action_j,
            "by_kind": self.by_kind(),
            "per_layer": self.per_layer(),
            "source": "edgekit x1 analytic cost model (targets/x1/costmodel.py), from the model shape alone",
        }


def kv_placement(shape: DecoderShape, machine: Machine, context: int) -> KvPlacement:
    """Split the KV banks evenly over layers; the newest `window` tokens stay, older ones spill to DRAM."""
    per_token = 2 * shape.kv_heads * shape.head_dim * machine.kv_bits / 8
    window = int(machine.kv_sram_bytes / shape.layers // per_token)
    resident = min(context, window)
    return KvPlacement(per_token, window, resident, context - resident)


def _weight_tensors(shape: DecoderShape) -> list[tuple[str, int, int]]:
    """Stored matrices (name, K, N) in the order they are placed: streamed matrices before the embedding table."""
    hd = shape.head_dim
    out = []
    for i in range(shape.layers):
        out += [
            (f"layers.{i}.q_proj", shape.hidden, shape.heads * hd),
            (f"layers.{i}.k_proj", shape.hidden, shape.kv_heads * hd),
            (f"layers.{i}.v_proj", shape.hidden, shape.kv_heads * hd),
            (f"layers.{i}.o_proj", shape.heads * hd, shape.hidden),
            (f"layers.{i}.gate_proj", shape.hidden, shape.intermediate),
            (f"layers.{i}.up_proj", shape.hidden, shape.intermediate),
            (f"layers.{i}.down_proj", shape.intermediate, shape.hidden),
        ]
    out.append(("lm_head", shape.hidden, shape.vocab))
    if not shape.tied_embeddings:
        out.append(("embed_tokens", shape.vocab, shape.hidden))
    return out


def place_weights(shape: DecoderShape, machine: Machine, dtype: str) -> dict[str, float]:
    """Fraction of each matrix held in external DRAM: near-memory fills in placement order, the rest spills."""
    free = machine.near_memory_bytes
    bits = machine.weight_bits(dtype)
    dram_fraction = {}
    for name, k, n in _weight_tensors(shape):
        size = k * n * bits / 8
        held = min(size, max(free, 0.0))
        free -= size
        dram_fraction[name] = 1.0 - held / size
    return dram_fraction


class CostBuilder:
    """Turns op descriptions into OpCosts for one machine and workload."""

    def __init__(self, machine: Machine, workload: Workload):
        self.m, self.w = machine, workload
        self.ops: list[OpCost] = []
        self.act_bytes = 2 if workload.weights == "fp16" else machine.numerics.activation_bits / 8

    def _finish(self, op: OpCost, compute_cycles: float, paths: dict[str, float]) -> None:
        m = self.m
        op.compute_s = compute_cycles / m.hz
        op.memory_s = max(paths.values(), default=0.0)
        op.overhead_s = m.queues.op_overhead_cycles / m.hz
        op.energy_j = sum(n * m.energy[a].pj for a, n in op.counts.items()) * 1e-12
        self.ops.append(op)

    def matmul(
        self, name: str, kind: str, layer: int | None, k: float, n: float, dram_fraction: float, rows: int = 1
    ) -> None:
        m, dtype = self.m, self.w.weights
        weights = k * n
        weight_bits = weights * m.weight_bits(dtype)
        counts = {
            _MAC_ACTION[dtype]: weights * rows,
            "near_memory_read_bit": weight_bits * (1 - dram_fraction),
            "dram_read_bit": weight_bits * dram_fraction,
            "sram_read_bit": k * rows * self.act_bytes * 8,
            "sram_write_bit": n * rows * 2 * 8,
        }
        if dtype != "fp16":
            counts["group_rescale"] = weights / m.numerics.weight_group_size * rows
        lanes = getattr(m.matrix, f"{dtype}_weights_per_cycle")
        cycles = weights / lanes * math.ceil(rows / m.matrix.rows)
        paths = {
            "near_memory": counts["near_memory_read_bit"] / 8 / m.near_memory_bandwidth,
            "dram": counts["dram_read_bit"] / 8 / m.dram_bandwidth,
            "sram": (counts["sram_read_bit"] + counts["sram_write_bit"]) / 8 / m.act_sram_bandwidth,
        }
        self._finish(OpCost(name, kind, layer, "matrix", counts), cycles, paths)

    def vector(
        self,
        name: str,
        kind: str,
        layer: int | None,
        elements: float,
        ops_per_element: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        m = self.m
        counts = {
            "vector_op": elements * ops_per_element,
            "sram_read_bit": elements * 2 * 8,
            "sram_write_bit": elements * 2 * 8,
        }
        for a, v in (extra or {}).items():
            counts[a] = counts.get(a, 0.0) + v
        cycles = elements * ops_per_element / m.vector.lanes
        kv = counts.get("_kv_sram_bits", 0.0)
        counts.pop("_kv_sram_bits", None)
        paths = {
            "sram": (counts["sram_read_bit"] + counts["sram_write_bit"] - kv) / 8 / m.act_sram_bandwidth,
            "kv_sram": kv / 8 / m.kv_sram_bandwidth,
            "near_memory": counts.get("near_memory_read_bit", 0.0) / 8 / m.near_memory_bandwidth,
            "dram": (counts.get("dram_write_bit", 0.0) + counts.get("dram_read_bit", 0.0)) / 8 / m.dram_bandwidth,
        }
        self._finish(OpCost(name, kind, layer, "vector", counts), cycles, paths)

    def attention_matmul(
        self,
        name: str,
        kind: str,
        layer: int,
        heads_active: float,
        groups_active: float,
        head_dim: int,
        kv: KvPlacement,
    ) -> None:
        """QK^T or PV for one decode row: each active head streams its group's K (or V) rows from the KV banks;
        spilled rows are fetched from DRAM once per active group and staged in SRAM."""
        m = self.m
        context = kv.resident + kv.spilled
        per_row_bits = head_dim * m.kv_bits
        dram_bits = groups_active * kv.spilled * per_row_bits
        counts = {
            "mac_int4xint8": heads_active * context * head_dim,
            "sram_read_bit": heads_active * context * per_row_bits,
            "sram_write_bit": dram_bits,
            "dram_read_bit": dram_bits,
        }
        cycles = counts["mac_int4xint8"] / (m.sram.kv_banks * m.attention.macs_per_kv_bank)
        paths = {
            "kv_sram": (counts["sram_read_bit"] + dram_bits) / 8 / m.kv_sram_bandwidth,
            "dram": dram_bits / 8 / m.dram_bandwidth,
        }
        self._finish(OpCost(name, kind, layer, "attention", counts), cycles, paths)


def estimate_decode(shape: DecoderShape, machine: Machine, workload: Workload) -> TokenEstimate:
    """Cost of generating one token at `workload.context` with the machine's numerics (decode, batch 1)."""
    m, w, v = machine, workload, machine.vector
    hd, s = shape.head_dim, workload.head_sparsity
    heads_active = shape.heads * (1.0 - s)  # the DSS target reached on average (the emulator measures it)
    # skips spread evenly over KV groups: a group goes silent only when fewer than one of its heads is left
    groups_active = shape.kv_heads * min(1.0, shape.group_size * (1.0 - s))
    kv = kv_placement(shape, m, w.context)
    placement = place_weights(shape, m, w.weights)
    b = CostBuilder(m, w)

    embed_bits = shape.hidden * m.weight_bits(w.weights)
    embed_dram = placement.get("embed_tokens", placement["lm_head"])
    b.vector(
        "embed_tokens",
        "embed_tokens",
        None,
        shape.hidden,
        1.0,
        {"near_memory_read_bit": embed_bits * (1 - embed_dram), "dram_read_bit": embed_bits * embed_dram},
    )
    for i in range(shape.layers):
        p = f"layers.{i}."
        b.vector(p + "input_norm", "rmsnorm", i, shape.hidden, v.rmsnorm_ops)
        b.matmul(p + "q_proj", "q_proj", i, shape.hidden, heads_active * hd, placement[p + "q_proj"])
        b.matmul(p + "k_proj", "k_proj", i, shape.hidden, shape.kv_heads * hd, placement[p + "k_proj"])
        b.matmul(p + "v_proj", "v_proj", i, shape.hidden, shape.kv_heads * hd, placement[p + "v_proj"])
        b.vector(p + "rope", "rope", i, (heads_active + shape.kv_heads) * hd, v.rope_ops)
        kv_values = 2 * shape.kv_heads * hd
        append_bits = kv_values * m.kv_bits
        extra = {"sram_write_bit": append_bits, "_kv_sram_bits": append_bits}
        if kv.spilled:  # the window is full: the oldest row moves out to DRAM as the new one comes in
            extra.update(sram_read_bit=append_bits, dram_write_bit=append_bits, _kv_sram_bits=2 * append_bits)
        b.vector(p + "kv_append", "kv_append", i, kv_values, v.quantize_ops, extra)
        b.attention_matmul(p + "attn_scores", "attn_scores", i, heads_active, groups_active, hd, kv)
        b.vector(p + "softmax", "softmax", i, heads_active * w.context, v.softmax_ops)
        b.attention_matmul(p + "attn_values", "attn_values", i, heads_active, groups_active, hd, kv)
        b.matmul(p + "o_proj", "o_proj", i, heads_active * hd, shape.hidden, placement[p + "o_proj"])
        b.vector(p + "attn_residual", "residual", i, shape.hidden, v.residual_ops)
        b.vector(p + "post_attention_norm", "rmsnorm", i, shape.hidden, v.rmsnorm_ops)
        b.matmul(p + "gate_proj", "gate_proj", i, shape.hidden, shape.intermediate, placement[p + "gate_proj"])
        b.matmul(p + "up_proj", "up_proj", i, shape.hidden, shape.intermediate, placement[p + "up_proj"])
        b.vector(p + "silu_mul", "silu_mul", i, shape.intermediate, v.silu_mul_ops)
        b.matmul(p + "down_proj", "down_proj", i, shape.intermediate, shape.hidden, placement[p + "down_proj"])
        b.vector(p + "mlp_residual", "residual", i, shape.hidden, v.residual_ops)
    b.vector("final_norm", "rmsnorm", None, shape.hidden, v.rmsnorm_ops)
    b.matmul("lm_head", "lm_head", None, shape.hidden, shape.vocab, placement["lm_head"])

    static_w = m.power.static_w
    by_action: dict[str, float] = defaultdict(float)
    for op in b.ops:
        for a, n in op.counts.items():
            by_action[a] += n * m.energy[a].pj * 1e-12
        static = static_w * op.time_s
        op.energy_j += static
        by_action["static"] += static
    weights_in_dram = sum(op.counts.get("dram_read_bit", 0.0) for op in b.ops if op.unit == "matrix") / 8
    return TokenEstimate(shape, w, m.machine.name, m.hash, b.ops, kv, static_w, weights_in_dram, dict(by_action))
