"""The X1 emulator: runs compiled programs with numpy, the spec's integer numerics, and a cycle and energy model.

Why this shape: the functional work and the accounting are separated. At load time each instruction is bound
once to a small closure (`_Binder`) with its operand slots, prepared weights (INT4 codes unpacked, FP16 scales
widened) and attributes resolved, so a run is a tight loop over closures on whole tensors with no per-call
decoding. An instruction's cost depends only on static shapes, the head mask and (attention, KV) the cache
length, so each closure keeps its own small table of finished cost entries (`_Entry`: cycles, bound, energy
per action and their sum) keyed by exactly those; per call only the queue clocks and running energy totals are
updated. Per-instruction records (`InstrRecord`) are built only when `RunResult.records` is read (traces,
profiles): reports never pay for them.

Timing and energy reuse the analytic cost model's per-op formulas (`costmodel._Builder`), fed with the shapes and
the KV state the emulator really sees, so the analytic and the emulated figures agree by construction. Queues:
LOAD (KVLD) runs ahead of COMPUTE from the start of a call, STORE (KVEVICT) runs beside it; an instruction that
needs their data waits (dependency token).

Storage simplification (documented in docs/x1 terms): tensors live in a table indexed by the memory plan's
tensor id (the plan gives each its ACT byte range); vector intermediates are kept in FP32, GEMM outputs are
rounded to FP16 as numerics.md says, the KV cache is INT4 + FP16 group scales in a resident window plus a spilled
DRAM region (kv-spill.md), with attention always over the whole context.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from edgekit.errors import EdgekitError

from .costmodel import KvPlacement, OpCost, Workload, _Builder
from .kernels import F16Gemm, IntGemm, dequantize_groups, erf, quantize_groups_int4, quantize_rows_int8, softmax, \
    to_fp16, unpack_int4_weight
from .machine import Machine
from .program import QUEUES, Program

FREE_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Shape"}  # addresses only (isa.md)


def _blas_limiter(threads: int | None):
    """A context manager holding the BLAS pool at `threads` during a run (None or no threadpoolctl: unchanged).

    Why: the emulator is single-threaded by design and compared with ONNX Runtime at one intra-op thread; its
    matrices are small, and OpenBLAS's worker threads spin-wait, so on a busy machine a threaded 200x64x128
    sgemm takes milliseconds instead of tens of microseconds. The numerics do not depend on the thread count."""
    if threads is None:
        return None
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    controller = ThreadpoolController()
    if not controller.select(user_api="blas").lib_controllers:
        return None
    return lambda: controller.limit(limits=threads, user_api="blas")


class EmulatorError(EdgekitError):
    """Inputs a program cannot run on (missing feed, wrong shape or dtype)."""


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

    def __init__(self, outputs: dict[str, np.ndarray], captured: dict[str, np.ndarray], totals: dict[str, float],
                 kv_state: "KVCache | None" = None, head_norms: np.ndarray | None = None, host_seconds: float = 0.0,
                 wall_seconds: float = 0.0, *, log: list | None = None, overridden: list[str] | None = None):
        self.outputs, self.captured, self.totals = outputs, captured, totals
        self.kv_state = kv_state
        self.head_norms = head_norms  # (layers, heads): L2 norm of each head's attention output, last row
        self.host_seconds, self.wall_seconds = host_seconds, wall_seconds
        self.overridden = overridden or []  # ONNX values replaced by `Emulator.run(overrides=...)`
        self._log = log or []
        self._records: list[InstrRecord] | None = None

    @property
    def records(self) -> list[InstrRecord]:
        if self._records is None:
            self._records = [InstrRecord(st.index, st.mnemonic, QUEUES[st.queue], st.symbol, st.layer, start,
                                         e.cycles, e.compute, e.memory, e.bound, dict(e.energy))
                             for st, start, e in self._log]
        return self._records


# ------------------------------------------------------------------------------------------------------------
class KVCache:
    """Per layer: resident rows (newest `window` positions) and spilled rows (DRAM), both INT4 + FP16 scales,
    in position order. Immutable per call: `copy()` before appending so a caller's `past` stays valid."""

    def __init__(self, layers: int, window: int, group: int):
        self.window, self.group = window, group
        self.res: list[list[np.ndarray] | None] = [None] * layers   # [kq, ks, vq, vs], (b, kv, T, hd|G)
        self.dram: list[list[np.ndarray] | None] = [None] * layers

    def copy(self) -> "KVCache":
        c = KVCache(len(self.res), self.window, self.group)
        c.res, c.dram = list(self.res), list(self.dram)
        return c

    def length(self, layer: int) -> tuple[int, int]:
        r = 0 if self.res[layer] is None else self.res[layer][0].shape[2]
        d = 0 if self.dram[layer] is None else self.dram[layer][0].shape[2]
        return r, d

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        kq, ks = quantize_groups_int4(k, self.group)
        vq, vs = quantize_groups_int4(v, self.group)
        new = [kq, ks, vq, vs]
        cur = self.res[layer]
        rows = new if cur is None else [np.concatenate([a, b], axis=2) for a, b in zip(cur, new)]
        over = rows[0].shape[2] - self.window
        if over > 0:  # oldest rows leave the ring for the spilled region (KVEVICT / prefill past the window)
            out = [a[:, :, :over] for a in rows]
            rows = [a[:, :, over:] for a in rows]
            d = self.dram[layer]
            self.dram[layer] = out if d is None else [np.concatenate([a, b], axis=2) for a, b in zip(d, out)]
        self.res[layer] = rows

    def full(self, layer: int) -> list[np.ndarray]:
        r, d = self.res[layer], self.dram[layer]
        if d is None:
            return r
        return [np.concatenate([a, b], axis=2) for a, b in zip(d, r)]

    def dequantized(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        kq, ks, vq, vs = self.full(layer)
        return dequantize_groups(kq, ks, self.group), dequantize_groups(vq, vs, self.group)

    @classmethod
    def from_arrays(cls, past: list[tuple[np.ndarray, np.ndarray]], window: int, group: int) -> "KVCache":
        c = cls(len(past), window, group)
        for i, (k, v) in enumerate(past):
            if k.shape[2]:
                c.append(i, np.asarray(k, np.float32), np.asarray(v, np.float32))
        return c


def kv_window(machine: Machine, layers: int, kv_heads: int, head_dim: int) -> tuple[int, float]:
    """kv-spill.md: window = floor(per-layer KV bytes / per-layer bytes per token)."""
    per_token = 2 * kv_heads * head_dim * machine.kv_bits / 8
    return int(machine.kv_sram_bytes // layers // per_token), per_token


# ------------------------------------------------------------------------------------------------------------
def _reshape(x, shape, allowzero=0):
    shape = [int(s) for s in shape]
    if not allowzero:
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


def _slice(x, starts, ends, axes=None, steps=None):
    axes = list(range(len(starts))) if axes is None else [int(a) % x.ndim for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    idx = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        idx[a] = slice(int(s), int(min(e, np.iinfo(np.int64).max)), int(st))
    return x[tuple(idx)]


_DT = {1: np.float32, 6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64, 2: np.uint8, 3: np.int8}


def _split(x, *rest, axis=0, num_outputs=None):
    if rest and rest[0] is not None:
        return np.split(x, np.cumsum(rest[0])[:-1], axis=axis)
    return np.array_split(x, num_outputs, axis=axis)


def _reduce(fn):
    def run(x, axes=None, keepdims=1, noop_with_empty_axes=0):
        ax = None if axes is None else tuple(int(a) for a in np.asarray(axes).reshape(-1))
        return fn(x, axis=ax, keepdims=bool(keepdims)).astype(x.dtype)
    return run


def _layernorm(x, scale, bias=None, axis=-1, epsilon=1e-5, stash_type=1):
    ax = tuple(range(axis % x.ndim, x.ndim))
    mean = x.mean(axis=ax, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=ax, keepdims=True)
    y = d / np.sqrt(var + np.float32(epsilon)) * scale
    return y + bias if bias is not None else y


GENERIC_FN = {
    "Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
    "Div": lambda a, b: (a // b) if a.dtype.kind in "iu" else a / b,
    "Neg": lambda a: -a, "Sqrt": np.sqrt, "Reciprocal": lambda a: np.float32(1.0) / a, "Cos": np.cos, "Sin": np.sin,
    "Erf": erf, "Tanh": np.tanh, "Sigmoid": lambda a: np.float32(1.0) / (np.float32(1.0) + np.exp(-a)),
    "Exp": np.exp, "Pow": lambda a, b: np.power(a, b).astype(a.dtype),
    "ReduceMean": _reduce(np.mean), "ReduceSum": _reduce(np.sum), "ReduceMax": _reduce(np.max),
    "Reshape": lambda x, s, allowzero=0: _reshape(x, s, allowzero),
    "Unsqueeze": lambda x, axes: np.expand_dims(x, tuple(int(a) for a in np.asarray(axes).reshape(-1))),
    "Squeeze": lambda x, axes=None: np.squeeze(x, None if axes is None else
                                                 tuple(int(a) for a in np.asarray(axes).reshape(-1))),
    "Flatten": lambda x, axis=1: x.reshape(int(np.prod(x.shape[:axis])), -1), "Identity": lambda x: x,
    "Transpose": lambda x, perm=None: np.transpose(x, perm), "Concat": None, "Split": _split,
    "Gather": lambda d, i, axis=0: np.take(d, i, axis=axis), "Slice": _slice,
    "Expand": lambda x, s: x * np.ones([int(v) for v in s], x.dtype),
    "Shape": lambda x, start=0, end=None: np.array(x.shape[start:end], np.int64),
    "Range": lambda a, b, d: np.arange(a, b, d, dtype=np.asarray(a).dtype),
    "Cast": lambda x, to, saturate=1: x.astype(_DT[to]),
    "ConstantOfShape": lambda s, value=(0.0,): np.full([int(v) for v in s], np.asarray(value).reshape(-1)[0]),
    "LessOrEqual": np.less_equal, "Less": np.less, "Greater": np.greater, "Equal": np.equal,
    "And": np.logical_and, "Or": np.logical_or, "Not": np.logical_not, "Where": np.where,
    "Softmax": lambda x, axis=-1: softmax(np.moveaxis(x, axis, -1)).swapaxes(-1, axis) if axis not in (-1, x.ndim - 1)
    else softmax(x),
    "LayerNormalization": _layernorm, "MatMul": np.matmul,
}
_MULTI_OUT = {"Split"}


# ------------------------------------------------------------------------------------------------------------
class _Entry:
    """One instruction's finished cost at one static shape: what a record and the running totals need."""

    __slots__ = ("cost", "cycles", "compute", "memory", "bound", "energy", "e_sum")

    def __init__(self, cost: OpCost, machine: Machine, hz: float):
        self.cost = cost
        self.compute = cost.compute_s * hz
        self.memory = cost.memory_s * hz
        self.cycles = max(self.compute, self.memory) + cost.overhead_s * hz
        self.bound = cost.bound
        energy = {a: n * machine.energy[a].pj for a, n in cost.counts.items() if n}
        energy["static"] = machine.power.static_w * self.cycles / hz * 1e12
        self.energy = energy
        self.e_sum = sum(energy.values())


class _Step:
    """One bound instruction: `fn(store, ctx) -> _Entry | None` does the work and names its cost."""

    __slots__ = ("fn", "index", "mnemonic", "queue", "wait", "layer", "symbol", "out_ids")

    def __init__(self, fn, index, mnemonic, queue, wait, layer, symbol, out_ids):
        self.fn, self.index, self.mnemonic, self.queue, self.wait = fn, index, mnemonic, queue, wait
        self.layer, self.symbol, self.out_ids = layer, symbol, out_ids


_WAIT_NONE, _WAIT_LOAD, _WAIT_STORE = 0, 1, 2


class _Costs:
    """Cost entries through the analytic model's formulas, memoised by what they depend on."""

    def __init__(self, machine: Machine):
        self.machine, self.hz = machine, machine.hz
        self.builders = {d: _Builder(machine, Workload(weights=d)) for d in ("int4", "int8", "fp16")}
        self.cache: dict[tuple, _Entry] = {}

    def _get(self, key, make) -> _Entry:
        e = self.cache.get(key)
        if e is None:
            e = self.cache[key] = _Entry(make(), self.machine, self.hz)
        return e

    def vector(self, kind, layer, elements, ops, extra=None) -> _Entry:
        def make():
            b = self.builders["int4"]
            b.vector(kind, kind, layer, float(elements), float(ops), extra)
            return b.ops.pop()
        return self._get(("v", kind, layer, elements, ops, tuple(sorted((extra or {}).items()))), make)

    def gemm(self, dtype, weight, layer, rows, kk, nn) -> _Entry:
        def make():
            b = self.builders[dtype]
            b.matmul(weight, "gemm", layer, kk, nn, 0.0, rows=rows)
            return b.ops.pop()
        return self._get(("g", weight, rows, kk, nn), make)

    def act_matmul(self, layer, size, shape_a, shape_b) -> _Entry:
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

    def attention(self, kind, layer, heads_active, groups_active, t, rows, head_dim, bytes_per_token,
                  window) -> _Entry:
        m = self.machine

        def make():
            b = self.builders["int4"]
            avg = max(1, int(round(t - (rows - 1) / 2)))  # causal: query rows see on average this many keys
            b.attention_matmul(kind, kind, layer, heads_active, groups_active, head_dim,
                               KvPlacement(bytes_per_token, window, avg, 0))
            c = b.ops.pop()
            if rows > 1:
                c.counts = {a: n * rows for a, n in c.counts.items()}
                c.compute_s *= rows
                c.memory_s *= rows
                c.energy_j = sum(n * m.energy[a].pj for a, n in c.counts.items()) * 1e-12
            return c
        return self._get(("att", kind, layer, heads_active, groups_active, t, rows), make)


# ------------------------------------------------------------------------------------------------------------
class _Binder:
    """Builds each instruction's closure. Closures read operands from the run's tensor table (`store`, a list
    indexed by memory-plan tensor id) and the per-call state (`ctx`), write their outputs back, and return their
    cost entry (None: free, or predicated off)."""

    def __init__(self, emu: "Emulator", program: Program):
        self.emu, self.program = emu, program
        self.costs, self.v = emu.costs, emu.machine.vector
        self.fused = self._fusable_gemms()

    def _fusable_gemms(self) -> dict[int, "_FusedGemm"]:
        """Integer GEMMs that read the same activation tensor (Q/K/V, gate/up) share one `_FusedGemm`, keyed by
        the index of each member's ATTR record. ONNX values are written once, so all members see the same input."""
        by_input: dict[tuple, list[dict]] = {}
        for ins in self.program.instructions:
            if ins.mnemonic not in ("XL_GEMM.W4A8", "XL_GEMM.W8A8"):
                continue
            attr = self.program.attrs[ins.operands[0]]
            if "im2col" in attr or "bias" in attr:
                continue
            by_input.setdefault((attr["in_ids"][0], attr["bits"], attr["k"], attr["group"]), []).append(attr)
        out = {}
        for members in by_input.values():
            if len(members) > 1:
                fused = _FusedGemm([self._int_gemm(a) for a in members], members, self.emu.head_dim)
                for a in members:
                    out[id(a)] = fused
        return out

    def _int_gemm(self, attr) -> IntGemm:
        w, name = self.program.weights, attr["weight"]
        q = w[f"{name}.q"]
        codes = unpack_int4_weight(q, attr["k"]) if attr["bits"] == 4 else q.T.astype(np.float32)
        return IntGemm(codes, w[f"{name}.s"], attr["group"])

    def bind(self, mnem: str, attr: dict):
        ins, outs = tuple(attr["in_ids"]), tuple(attr["out_ids"])
        layer = attr.get("layer")
        if "op" in attr:
            return self._generic(attr, ins, outs, layer)
        if mnem.startswith("XL_GEMM"):
            return self._gemm(mnem, attr, ins, outs, layer)
        maker = {"VRMSNORM": self._rmsnorm, "VSILU_MUL": self._silu_mul, "VGELU": self._gelu,
                 "XL_ROPE_ROTATE": self._rope, "KVEVICT": self._kv_evict, "KVAPPEND": self._kv_append,
                 "KVLD": self._kv_load, "XL_VMATMUL_CAUSAL": self._scores, "XL_VMATMUL_PV": self._pv,
                 "HOSTCALL": self._hostcall}.get(mnem)
        if mnem == "VSOFTMAX" and attr.get("attn"):
            maker = self._attn_softmax
        if maker is None:
            def unknown(store, ctx):
                raise EmulatorError(f"instruction {mnem} has no semantics in this emulator")
            return unknown
        return maker(attr, ins, outs, layer)

    # -- generic one-to-one lowering ---------------------------------------------------------------------------
    def _generic(self, attr, ins, outs, layer):
        """numpy semantics of the ONNX op; vector or layout costs by output size."""
        costs = self.costs
        op, a = attr["op"], attr["attrs"]
        fast = self._layout(op, a, attr, ins, outs)
        if fast is not None:
            return fast
        if op == "Concat":
            axis = a.get("axis", 0)

            def compute(args):
                return [np.concatenate(args, axis=axis)]
        else:
            f = GENERIC_FN[op]
            multi, widen = op in _MULTI_OUT, op not in ("Shape", "Range", "Cast")

            def compute(args):
                r = f(*args, **a)
                y = list(r) if multi else [r]
                if widen and isinstance(y[0], np.ndarray) and y[0].dtype == np.float64:
                    y = [y[0].astype(np.float32)]
                return y
        if op in FREE_OPS:
            def free(store, ctx):
                for i, o in zip(outs, compute([store[i] for i in ins])):
                    store[i] = o
            return free
        if op == "MatMul":
            def matmul(store, ctx):
                args = [store[i] for i in ins]
                y = compute(args)
                for i, o in zip(outs, y):
                    store[i] = o
                return costs.act_matmul(layer, int(np.size(y[0])), args[0].shape, args[1].shape)
            return matmul
        ops = {"Softmax": self.v.softmax_ops, "LayerNormalization": self.v.rmsnorm_ops}.get(op, self.v.residual_ops)
        table: dict = {}
        if len(outs) == 1:
            o0 = outs[0]

            def vector1(store, ctx):
                y = compute([store[i] for i in ins])
                y0 = store[o0] = y[0]
                size = int(np.size(y0))
                e = table.get(size)
                if e is None:
                    e = table[size] = costs.vector(op, layer, size, ops)
                return e
            return vector1

        def vector(store, ctx):
            y = compute([store[i] for i in ins])
            for i, o in zip(outs, y):
                store[i] = o
            size = int(np.size(y[0]))
            e = table.get(size)
            if e is None:
                e = table[size] = costs.vector(op, layer, size, ops)
            return e
        return vector

    def _layout(self, op, a, attr, ins, outs):
        """Reshape to a constant shape and Transpose: the numpy call the generic path ends in, bound directly."""
        if op == "Reshape" and len(attr["in"]) == 2 and attr["in"][1] in attr.get("const", {}):
            shape = [int(v) for v in np.asarray(self.program.weights[attr["const"][attr["in"][1]]]).reshape(-1)]
            if 0 in shape and not a.get("allowzero", 0):
                return None  # 0 copies the input's dim: resolved per call by the generic path
            shape_t, x_id, y_id = tuple(shape), ins[0], outs[0]

            def reshape(store, ctx):
                store[y_id] = store[x_id].reshape(shape_t)
            return reshape
        if op == "Transpose" and len(ins) == 1 and set(a) <= {"perm"}:
            perm, x_id, y_id = a.get("perm"), ins[0], outs[0]
            entry = self._sized("Transpose", attr.get("layer"), self.v.residual_ops)

            def transpose(store, ctx):
                y = store[y_id] = np.transpose(store[x_id], perm)
                return entry(y.size)
            return transpose
        return None

    # -- matrix unit -------------------------------------------------------------------------------------------
    def _gemm(self, mnem, attr, ins, outs, layer):
        w, emu, costs = self.program.weights, self.emu, self.costs
        name = attr["weight"]
        k, n = attr["k"], attr["n"]
        dtype = {16: "fp16", 8: "int8", 4: "int4"}[attr["bits"]]
        role = attr.get("head_role") if emu.head_dim else None
        x_id, y_id = ins[0], outs[0]
        table: dict = {}
        fused = self.fused.get(id(attr))
        if fused is not None:
            first = fused.attrs[0] is attr

            def run_fused(store, ctx):
                if first:
                    fused.run(store, ctx)
                frac = ctx.frac[layer] if role is not None and ctx.mask is not None and layer is not None else 1.0
                rows = fused.rows
                key = (rows, frac)
                e = table.get(key)
                if e is None:
                    kk, nn = (k * frac, n) if role == "o_proj" else (k, n * frac if role == "q_proj" else n)
                    e = table[key] = costs.gemm(dtype, name, layer, rows, kk, nn)
                return e
            return run_fused
        if mnem in ("XL_GEMM.W4A8", "XL_GEMM.W8A8"):
            gemm = self._int_gemm(attr)
        else:
            gemm = F16Gemm(w[f"{name}.w"])
        bias = np.asarray(w[attr["bias"]], np.float32) if "bias" in attr else None
        im2col = attr.get("im2col")

        def run(store, ctx):
            x = store[x_id]
            if im2col:
                kh, kw = im2col
                n_, c, h, w_ = x.shape
                x = x.reshape(n_, c, h // kh, kh, w_ // kw, kw).transpose(0, 2, 4, 1, 3, 5).reshape(
                    n_, (h // kh) * (w_ // kw), c * kh * kw)
            col_mask, frac = None, 1.0
            if role is not None and ctx.mask is not None and layer is not None:
                frac = ctx.frac[layer]
                if role == "q_proj":
                    col_mask = ctx.col_mask[layer]
            y = gemm(x, col_mask)
            if bias is not None:
                y = y + bias
            if im2col:
                y = y.reshape(x.shape[0], h // kh, w_ // kw, n).transpose(0, 3, 1, 2)
            store[y_id] = y
            rows = math.prod(x.shape[:-1])
            key = (rows, frac)
            e = table.get(key)
            if e is None:
                kk, nn = (k * frac, n) if role == "o_proj" else (k, n * frac if role == "q_proj" else n)
                e = table[key] = costs.gemm(dtype, name, layer, rows, kk, nn)
            return e
        return run

    # -- vector unit -------------------------------------------------------------------------------------------
    def _sized(self, kind, layer, ops):
        """A cost table for a vector op whose cost depends on its element count only."""
        costs, table = self.costs, {}

        def entry(size):
            e = table.get(size)
            if e is None:
                e = table[size] = costs.vector(kind, layer, size, ops)
            return e
        return entry

    def _rmsnorm(self, attr, ins, outs, layer):
        gamma = np.asarray(self.program.weights[attr["gamma"]], np.float32)
        eps, one = np.float32(attr["eps"]), np.float32(1.0)
        entry = self._sized("rmsnorm", layer, self.v.rmsnorm_ops)
        x_id, y_id = ins[0], outs[0]

        def run(store, ctx):
            x = store[x_id]
            # np.mean(x * x, axis=-1, keepdims=True), as np.mean computes it, without its Python wrapper
            ms = np.add.reduce(x * x, axis=-1, keepdims=True)
            if isinstance(ms, np.ndarray):
                np.true_divide(ms, np.intp(x.shape[-1]), out=ms, casting="unsafe")
            else:
                ms = np.mean(x * x, axis=-1, keepdims=True)
            store[y_id] = x * (one / np.sqrt(ms + eps)) * gamma
            return entry(x.size)
        return run

    def _silu_mul(self, attr, ins, outs, layer):
        entry = self._sized("silu_mul", layer, self.v.silu_mul_ops)
        g_id, u_id, y_id = ins[0], ins[1], outs[0]
        one = np.float32(1.0)

        def run(store, ctx):
            g = store[g_id]
            store[y_id] = g / (one + np.exp(-g)) * store[u_id]
            return entry(g.size)
        return run

    def _gelu(self, attr, ins, outs, layer):
        entry = self._sized("gelu", layer, self.v.silu_mul_ops)
        x_id, y_id = ins[0], outs[0]
        half, inv_sqrt2, one = np.float32(0.5), np.float32(1.0 / math.sqrt(2.0)), np.float32(1.0)

        def run(store, ctx):
            x = store[x_id]
            store[y_id] = x * half * (erf(x * inv_sqrt2) + one)
            return entry(x.size)
        return run

    def _rope(self, attr, ins, outs, layer):
        entry = self._sized("rope", layer, self.v.rope_ops)
        x_id, cos_id, sin_id, y_id = *ins[:3], outs[0]
        is_q = attr.get("role") == "q"

        def run(store, ctx):
            x = store[x_id]
            half = x.shape[-1] // 2
            rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            store[y_id] = x * store[cos_id] + rot * store[sin_id]
            frac = ctx.frac[layer] if is_q and ctx.mask is not None and layer is not None else 1.0
            return entry(x.size * frac)
        return run

    # -- KV cache ----------------------------------------------------------------------------------------------
    def _kv_evict(self, attr, ins, outs, layer):
        costs, kv_bits = self.costs, self.emu.machine.kv_bits
        k_id = ins[0]

        def run(store, ctx):
            k = store[k_id]
            res, _ = ctx.kv.length(layer)
            evicted = max(0, min(res, res + k.shape[2] - ctx.kv.window))
            if not evicted:
                return None  # predicated off: the window still has room
            ebits = evicted * 2 * k.shape[0] * k.shape[1] * k.shape[3] * kv_bits
            return costs.vector("kv_evict", layer, 0, 1, {"sram_read_bit": ebits, "dram_write_bit": ebits,
                                                          "_kv_sram_bits": ebits})
        return run

    def _kv_append(self, attr, ins, outs, layer):
        costs, kv_bits, ops = self.costs, self.emu.machine.kv_bits, self.v.quantize_ops
        k_id, v_id = ins[0], ins[1]
        table: dict = {}

        def run(store, ctx):
            k = store[k_id]
            ctx.kv.append(layer, k, store[v_id])
            values = 2 * k.size
            e = table.get(values)
            if e is None:
                bits = values * kv_bits
                e = table[values] = costs.vector("kv_append", layer, values, ops,
                                                 {"sram_write_bit": bits, "_kv_sram_bits": bits})
            return e
        return run

    def _kv_load(self, attr, ins, outs, layer):
        emu, costs = self.emu, self.costs

        def run(store, ctx):
            res, dram = ctx.kv.length(layer)
            ctx.ctx_len[layer] = (res, dram)
            if not dram:
                return None
            groups = ctx.groups_active(layer)
            b_ = ctx.kv.res[layer][0].shape[0]
            bits = groups * dram * emu.head_dim * emu.machine.kv_bits * 2 * b_
            return costs.vector("kv_load", layer, 0, 1, {"dram_read_bit": bits, "sram_write_bit": bits})
        return run

    # -- attention engine --------------------------------------------------------------------------------------
    def _attn_entry(self, kind, layer, ctx, t, rows) -> _Entry:
        emu = self.emu
        return self.costs.attention(kind, layer, emu.heads * ctx.frac_or_one(layer), ctx.groups_active(layer), t,
                                    rows, emu.head_dim, emu.kv_bytes_per_token, emu.window)

    def _scores(self, attr, ins, outs, layer):
        emu = self.emu
        q_id, m_id, s_id = ins[0], ins[1], outs[0]
        scale = np.float32(attr["scale"])
        kvh = emu.kv_heads

        def run(store, ctx):
            q, mask = store[q_id], store[m_id]
            kv = ctx.kv
            kq, ks, _, _ = kv.full(layer)  # (b, kv, T, hd) int8, (b, kv, T, G) f16
            b, h, s_, d = q.shape
            qg = q.reshape(b, kvh, h // kvh, s_, d)  # (b, kv, g, s, hd)
            q_int, q_s = quantize_rows_int8(qg)  # per head row
            group = kv.group
            G = kq.shape[-1] // group
            kf = kq.astype(np.float32)
            ksf = ks.astype(np.float32)
            if G == 1:
                s = np.matmul(q_int, kf[:, :, None].swapaxes(-1, -2)) * ksf[:, :, None, None, :, 0]
            else:
                s = 0
                for j in range(G):
                    sl = slice(j * group, (j + 1) * group)
                    s = s + np.matmul(q_int[..., sl], kf[:, :, None, :, sl].swapaxes(-1, -2)) \
                        * ksf[:, :, None, None, :, j]
            store[s_id] = s * q_s / scale + mask
            res, dram = kv.length(layer)
            return self._attn_entry("attn_scores", layer, ctx, res + dram, s_ * b)
        return run

    def _attn_softmax(self, attr, ins, outs, layer):
        entry = self._sized("softmax", layer, self.v.softmax_ops)
        s_id, p_id = ins[0], outs[0]
        one, c127 = np.float32(1.0), np.float32(127.0)

        def run(store, ctx):
            s = store[s_id]
            p = softmax(s)
            amax = p.max(axis=-1, keepdims=True)
            p_s = amax / c127
            store[p_id] = (np.rint(p / np.where(p_s == 0, one, p_s)), p_s)
            return entry(s.size * ctx.frac_or_one(layer))
        return run

    def _pv(self, attr, ins, outs, layer):
        emu = self.emu
        p_id, o_id = ins[0], outs[0]
        kvh = emu.kv_heads

        def run(store, ctx):
            p_int, p_s = store[p_id]
            kv = ctx.kv
            _, _, vq, vs = kv.full(layer)
            v = dequantize_groups(vq, vs, kv.group)  # v_int * v_s16 per row and group, FP32
            o = np.matmul(p_int, v[:, :, None]) * p_s  # (b, kv, g, s, hd)
            act = ctx.mask[layer] if ctx.mask is not None and layer is not None else None
            if act is not None:
                o = o * act.reshape(1, kvh, -1, 1, 1)
            o = to_fp16(o)
            store[o_id] = o
            norms = np.linalg.norm(o[0, :, :, -1, :], axis=-1).reshape(-1)
            ctx.head_norms[layer] = norms if act is None else np.where(act, norms, np.nan)
            res, dram = kv.length(layer)
            return self._attn_entry("attn_values", layer, ctx, res + dram, o.shape[3] * o.shape[0])
        return run

    # -- host --------------------------------------------------------------------------------------------------
    def _hostcall(self, attr, ins, outs, layer):
        import onnxruntime as ort

        part = self.program.host[attr["partition"]]
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sess = ort.InferenceSession(self.program.host_models[attr["partition"]], so,
                                    providers=["CPUExecutionProvider"])
        entry = self._sized("hostcall", layer, 1)
        names_in, names_out = part["inputs"], part["outputs"]

        def run(store, ctx):
            h0 = time.perf_counter()
            y = sess.run(names_out, dict(zip(names_in, [store[i] for i in ins])))
            ctx.host_s += time.perf_counter() - h0
            for i, o in zip(outs, y):
                store[i] = o
            return entry(0)
        return run


class _FusedGemm:
    """Integer GEMMs over one input computed as one (`IntGemm.fused`): bit-identical column slices, one
    activation quantisation and one matmul. The first member's step computes and publishes every member's output;
    each member still reports its own cost, so records and totals are those of the separate instructions."""

    def __init__(self, gemms: list[IntGemm], attrs: list[dict], head_dim: int):
        self.attrs = attrs
        self.gemm = IntGemm.fused(gemms)
        self.x_id = attrs[0]["in_ids"][0]
        self.out_ids = [a["out_ids"][0] for a in attrs]
        bounds = np.cumsum([0] + [g.n for g in gemms])
        self.slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.q_part = next((i for i, a in enumerate(attrs) if head_dim and a.get("head_role") == "q_proj"), None)
        self.layer = attrs[0].get("layer")
        self.rows = 0

    def run(self, store: list, ctx) -> None:
        x = store[self.x_id]
        col_mask = None
        if self.q_part is not None and ctx.mask is not None and self.layer is not None:
            col_mask = np.ones(self.gemm.n, np.float32)  # x * 1.0 is exact: other members are unmasked
            col_mask[self.slices[self.q_part]] = ctx.col_mask[self.layer]
        y = self.gemm(x, col_mask)
        self.rows = math.prod(x.shape[:-1])
        contiguous = self.rows == 1
        for tid, sl in zip(self.out_ids, self.slices):
            part = y[..., sl]
            store[tid] = part if contiguous else np.ascontiguousarray(part)


class _Prepared:
    """One program bound for execution: its steps, the tensor table's initial contents, and its I/O."""

    def __init__(self, name: str, program: Program, emu: "Emulator"):
        self.name, self.program = name, program
        plan = program.memory_plan["tensors"]
        self.ids = {t["name"]: i for i, t in enumerate(plan)}
        self.n_tensors = len(plan)
        self.preload: dict[int, np.ndarray] = {}
        self.steps: list[_Step] = []
        self.host_sessions = {}
        binder = _Binder(emu, program)
        for idx, ins in enumerate(program.instructions):
            if ins.mnemonic == "END":
                continue
            attr = program.attrs[ins.operands[0]]
            for cname, key in attr.get("const", {}).items():
                self.preload[self.ids[cname]] = np.asarray(program.weights[key])
            mnem = ins.mnemonic
            queue = 0 if mnem == "KVLD" else (2 if mnem == "KVEVICT" else 1)
            wait = _WAIT_LOAD if mnem == "XL_VMATMUL_CAUSAL" else (_WAIT_STORE if mnem == "KVAPPEND" else _WAIT_NONE)
            self.steps.append(_Step(binder.bind(mnem, attr), idx, mnem, queue, wait, attr.get("layer"),
                                    program.symbols.get(idx, ""), tuple(attr["out_ids"])))
        self.base_store: list = [None] * self.n_tensors
        for i, a in self.preload.items():
            self.base_store[i] = a
        self.inputs = [i["name"] for i in program.io["inputs"]]
        self.outputs = [o["name"] for o in program.io["outputs"]]
        self.kv_outputs = {int(k): v for k, v in program.io.get("kv_outputs", {}).items()}


class Emulator:
    """Runs the programs of one model: `run(graph, feeds, head_mask=..., capture=..., overrides=...)`."""

    def __init__(self, programs: dict[str, Program], machine: Machine, *, blas_threads: int | None = 1):
        for name, p in programs.items():
            if p.machine_hash != machine.hash:
                raise EmulatorError(f"program '{name}' was compiled for machine {p.machine_hash[:16]}, not "
                                    f"'{machine.machine.name}' ({machine.short_hash})")
        self.machine = machine
        self.programs = programs
        self.costs = _Costs(machine)
        self._blas = _blas_limiter(blas_threads)
        self.kv_group = machine.numerics.kv_group_size
        self.hz = machine.hz
        self.overhead = machine.queues.op_overhead_cycles
        dec = programs.get("decoder")
        self.layers = len(dec.io.get("kv_outputs", {})) if dec else 0
        self.kv_heads = self.head_dim = self.heads = 0
        self.window, self.kv_bytes_per_token = 0, 0.0
        if dec:
            shape = next(i["shape"] for i in dec.io["inputs"] if i["name"] == "past_key_values.0.key")
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
            for ins in dec.instructions:
                if ins.mnemonic in ("XL_GEMM.W4A8", "XL_GEMM.F16", "XL_GEMM.W8A8"):
                    attr = dec.attrs[ins.operands[0]]
                    if attr.get("head_role") == "q_proj":
                        self.heads = attr["n"] // self.head_dim
                        break
            self.window, self.kv_bytes_per_token = kv_window(machine, self.layers, self.kv_heads, self.head_dim)
        self.prepared = {name: _Prepared(name, p, self) for name, p in programs.items()}

    # ---------------------------------------------------------------------------------------------------------
    def new_kv(self) -> KVCache:
        return KVCache(self.layers, self.window, min(self.kv_group, self.head_dim))

    def run(self, graph: str, feeds: dict[str, np.ndarray], *, head_mask: np.ndarray | None = None,
            capture: set[str] | None = None, kv_state: KVCache | None = None, want_present: bool = True,
            overrides: dict[str, np.ndarray] | None = None) -> RunResult:
        """Execute one program. `overrides` maps ONNX value names to arrays that replace the emulator's own value
        when the instruction producing it has run (cast to the dtype and shape the emulator holds it in), before
        any consumer reads it: per-layer accuracy analysis feeds reference inputs this way. Values the program
        does not materialise (fused away) or holds quantised are not substituted; `RunResult.overridden` lists
        those that were."""
        if graph not in self.prepared:
            raise EmulatorError(f"no program for graph '{graph}' (have: {', '.join(self.prepared)})")
        if self._blas is None:
            return self._run(graph, feeds, head_mask, capture, kv_state, want_present, overrides)
        with self._blas():
            return self._run(graph, feeds, head_mask, capture, kv_state, want_present, overrides)

    def _run(self, graph, feeds, head_mask, capture, kv_state, want_present, overrides) -> RunResult:
        t0 = time.perf_counter()
        prep = self.prepared[graph]
        store = list(prep.base_store)
        ids = prep.ids
        for name in prep.inputs:
            if name.startswith("past_key_values.") and kv_state is not None:
                continue
            if name not in feeds:
                raise EmulatorError(f"graph '{graph}': missing input '{name}'")
            if name in ids:
                store[ids[name]] = np.asarray(feeds[name])
        kv = None
        if prep.kv_outputs:
            if kv_state is not None:
                kv = kv_state.copy()
            else:
                past = [(feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"])
                        for i in range(self.layers)]
                kv = KVCache.from_arrays(past, self.window, min(self.kv_group, self.head_dim))
        mask = None if head_mask is None else np.asarray(head_mask, bool)
        if mask is not None and mask.shape != (self.layers, self.heads):
            raise EmulatorError(f"head_mask has shape {mask.shape}, expected ({self.layers}, {self.heads})")
        ctx = _RunContext(self, kv, mask)
        by_id = {ids[n]: np.asarray(v) for n, v in (overrides or {}).items() if n in ids}
        replaced: list[str] = []
        names = {i: n for n, i in ids.items()} if by_id else {}

        log: list = []
        energies: list[float] = []
        c0 = c1 = c2 = 0.0
        load_ready: dict = {}
        store_ready = 0.0
        for st in prep.steps:
            e = st.fn(store, ctx)
            if by_id:
                self._substitute(st, store, by_id, names, replaced)
            if e is None:
                continue
            cyc = e.cycles
            q = st.queue
            if q == 1:
                start = c1
                if st.wait == _WAIT_LOAD:
                    start = max(start, load_ready.get(st.layer, 0.0))
                elif st.wait == _WAIT_STORE:
                    start = max(start, store_ready)
                c1 = start + cyc
            elif q == 0:
                start = c0  # the LOAD queue runs ahead: spilled rows do not depend on this token's compute
                c0 = start + cyc
                load_ready[st.layer] = c0
            else:
                start = max(c2, c1)
                c2 = start + cyc
                store_ready = c2
            energies.append(e.e_sum)
            log.append((st, start, e))
        outputs = {}
        for name in prep.outputs:
            if name in ids and store[ids[name]] is not None:
                outputs[name] = store[ids[name]]
        if kv is not None and want_present:
            for layer, (kname, vname) in prep.kv_outputs.items():
                outputs[kname], outputs[vname] = kv.dequantized(layer)
        captured = {n: store[ids[n]] for n in (capture or ()) if n in ids and store[ids[n]] is not None}
        cycles = max(c0, c1, c2)
        totals = {"cycles": cycles, "seconds": cycles / self.hz, "energy_j": sum(energies) * 1e-12,
                  "instructions": len(log), "host_partitions_s": ctx.host_s}
        return RunResult(outputs, captured, totals, kv, ctx.head_norms if prep.kv_outputs else None,
                         ctx.host_s, time.perf_counter() - t0, log=log, overridden=replaced)

    @staticmethod
    def _substitute(st: _Step, store: list, by_id: dict, names: dict, replaced: list) -> None:
        for tid in st.out_ids:
            if tid in by_id and isinstance(store[tid], np.ndarray):
                cur = store[tid]
                store[tid] = by_id[tid].astype(cur.dtype).reshape(cur.shape)
                replaced.append(names[tid])


class _RunContext:
    """Per-call state: the KV cache, the head mask (and what follows from it per layer), attention statistics."""

    __slots__ = ("kv", "mask", "frac", "col_mask", "_groups", "head_norms", "ctx_len", "host_s", "kv_heads")

    def __init__(self, emu: Emulator, kv: KVCache | None, mask: np.ndarray | None):
        self.kv, self.mask = kv, mask
        self.kv_heads = emu.kv_heads
        self.head_norms = np.full((emu.layers, emu.heads), np.nan, np.float32) if emu.layers else None
        self.ctx_len: dict[int, tuple[int, int]] = {}
        self.host_s = 0.0
        self.frac: list[float] = []
        self.col_mask: list[np.ndarray] = []
        self._groups: list[int] = []
        if mask is not None:
            self.frac = [float(m.mean()) for m in mask]
            self.col_mask = [np.repeat(m, emu.head_dim).astype(np.float32) for m in mask]
            self._groups = [int(m.reshape(emu.kv_heads, -1).any(1).sum()) for m in mask]

    def frac_or_one(self, layer) -> float:
        return 1.0 if self.mask is None or layer is None else self.frac[layer]

    def groups_active(self, layer) -> int:
        return self.kv_heads if self.mask is None or layer is None else self._groups[layer]
