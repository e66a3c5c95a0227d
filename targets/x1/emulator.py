"""The X1 emulator: runs compiled programs with numpy, the spec's integer numerics, and a cycle and energy model.

Why this shape: each instruction is decoded once into a closure bound to its prepared weights (INT4 codes
unpacked, FP16 scales widened), so a run is a loop over closures on whole tensors, vectorised per instruction:
the emulator stays within a small factor of ONNX Runtime. Timing and energy reuse the analytic cost model's
per-op formulas (`costmodel._Builder`), fed with the shapes and the KV state the emulator really sees, so the
analytic and the emulated figures agree by construction. Queues: LOAD (KVLD) runs ahead of COMPUTE from the
start of a call, STORE (KVEVICT) runs beside it; an instruction that needs their data waits (dependency token).

Storage simplification (documented in docs/x1 terms): tensors live in a table indexed by the memory plan's
tensor id (the plan gives each its ACT byte range); vector intermediates are kept in FP32, GEMM outputs are
rounded to FP16 as numerics.md says, the KV cache is INT4 + FP16 group scales in a resident window plus a spilled
DRAM region (kv-spill.md), with attention always over the whole context.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from edgekit.errors import EdgekitError

from .costmodel import KvPlacement, OpCost, Workload, _Builder
from .kernels import F16Gemm, IntGemm, dequantize_groups, erf, quantize_groups_int4, quantize_rows_int8, softmax, \
    to_fp16, unpack_int4_weight
from .machine import Machine
from .program import QUEUES, Program

FREE_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Shape"}  # addresses only (isa.md)


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


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    records: list[InstrRecord]
    captured: dict[str, np.ndarray]
    totals: dict[str, float]
    kv_state: "KVCache | None" = None
    head_norms: np.ndarray | None = None  # (layers, heads): L2 norm of each head's attention output, last row
    host_seconds: float = 0.0
    wall_seconds: float = 0.0


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
class _Prepared:
    """One program decoded for execution: closures, tensor table layout and static costs."""

    def __init__(self, name: str, program: Program, machine: Machine):
        self.name, self.program = name, program
        plan = program.memory_plan["tensors"]
        self.ids = {t["name"]: i for i, t in enumerate(plan)}
        self.n_tensors = len(plan)
        self.preload: dict[int, np.ndarray] = {}
        self.steps = []
        self.host_sessions = {}
        for idx, ins in enumerate(program.instructions):
            if ins.mnemonic == "END":
                continue
            attr = program.attrs[ins.operands[0]]
            for cname, key in attr.get("const", {}).items():
                self.preload[self.ids[cname]] = np.asarray(program.weights[key])
            self.steps.append((idx, ins.mnemonic, attr, program.symbols.get(idx, ""), self._bind(ins.mnemonic, attr)))
        self.inputs = [i["name"] for i in program.io["inputs"]]
        self.outputs = [o["name"] for o in program.io["outputs"]]
        self.kv_outputs = {int(k): v for k, v in program.io.get("kv_outputs", {}).items()}

    def _bind(self, mnem: str, attr: dict):
        w = self.program.weights
        if mnem in ("XL_GEMM.W4A8", "XL_GEMM.W8A8"):
            name = attr["weight"]
            q = w[f"{name}.q"]
            codes = unpack_int4_weight(q, attr["k"]) if attr["bits"] == 4 else q.T.astype(np.float32)
            gemm = IntGemm(codes, w[f"{name}.s"], attr["group"])
        elif mnem == "XL_GEMM.F16":
            gemm = F16Gemm(w[f"{attr['weight']}.w"])
        else:
            gemm = None
        if gemm is not None:
            bias = np.asarray(w[attr["bias"]], np.float32) if "bias" in attr else None
            return (gemm, bias)
        if mnem == "HOSTCALL":
            import onnxruntime as ort

            part = self.program.host[attr["partition"]]
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            return ort.InferenceSession(self.program.host_models[attr["partition"]], so,
                                        providers=["CPUExecutionProvider"]), part
        if "gamma" in attr:
            return np.asarray(w[attr["gamma"]], np.float32)
        return None


class Emulator:
    """Runs the programs of one model: `run(graph, feeds, head_mask=..., capture=...) -> RunResult`."""

    def __init__(self, programs: dict[str, Program], machine: Machine):
        for name, p in programs.items():
            if p.machine_hash != machine.hash:
                raise EmulatorError(f"program '{name}' was compiled for machine {p.machine_hash[:16]}, not "
                                    f"'{machine.machine.name}' ({machine.short_hash})")
        self.machine = machine
        self.programs = programs
        self.prepared = {name: _Prepared(name, p, machine) for name, p in programs.items()}
        self._builders = {d: _Builder(machine, Workload(weights=d)) for d in ("int4", "int8", "fp16")}
        self._cost_cache: dict[tuple, OpCost] = {}
        self.kv_group = machine.numerics.kv_group_size
        self.hz = machine.hz
        self.overhead = machine.queues.op_overhead_cycles
        dec = self.prepared.get("decoder")
        self.layers = len(dec.kv_outputs) if dec else 0
        self.kv_heads = self.head_dim = self.heads = 0
        if dec:
            shape = next(i["shape"] for i in programs["decoder"].io["inputs"] if i["name"] == "past_key_values.0.key")
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
            for step in dec.steps:
                if step[1] == "XL_GEMM.W4A8" or step[1] == "XL_GEMM.F16" or step[1] == "XL_GEMM.W8A8":
                    if step[2].get("head_role") == "q_proj":
                        self.heads = step[2]["n"] // self.head_dim
                        break
            self.window, self.kv_bytes_per_token = kv_window(machine, self.layers, self.kv_heads, self.head_dim)

    # ---------------------------------------------------------------------------------------------------------
    def new_kv(self) -> KVCache:
        return KVCache(self.layers, self.window, min(self.kv_group, self.head_dim))

    def run(self, graph: str, feeds: dict[str, np.ndarray], *, head_mask: np.ndarray | None = None,
            capture: set[str] | None = None, kv_state: KVCache | None = None,
            want_present: bool = True) -> RunResult:
        if graph not in self.prepared:
            raise EmulatorError(f"no program for graph '{graph}' (have: {', '.join(self.prepared)})")
        t0 = time.perf_counter()
        prep = self.prepared[graph]
        store: list = [None] * prep.n_tensors
        for i, a in prep.preload.items():
            store[i] = a
        for name in prep.inputs:
            if name.startswith("past_key_values.") and kv_state is not None:
                continue
            if name not in feeds:
                raise EmulatorError(f"graph '{graph}': missing input '{name}'")
            if name in prep.ids:
                store[prep.ids[name]] = np.asarray(feeds[name])
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
        records, host_s = [], 0.0
        clocks = [0.0, 0.0, 0.0]
        for idx, mnem, attr, symbol, bound in prep.steps:
            ins = [store[i] for i in attr["in_ids"]]
            h0 = time.perf_counter() if mnem == "HOSTCALL" else 0.0
            outs, cost = ctx.execute(mnem, attr, ins, bound)
            if mnem == "HOSTCALL":
                host_s += time.perf_counter() - h0
            for i, o in zip(attr["out_ids"], outs):
                store[i] = o
            if cost is None:
                continue
            records.append(self._record(idx, mnem, symbol, attr, cost, clocks, ctx))
        outputs = {}
        for name in prep.outputs:
            if name in prep.ids and store[prep.ids[name]] is not None:
                outputs[name] = store[prep.ids[name]]
        if kv is not None and want_present:
            for layer, (kname, vname) in prep.kv_outputs.items():
                outputs[kname], outputs[vname] = kv.dequantized(layer)
        captured = {n: store[prep.ids[n]] for n in (capture or ()) if n in prep.ids and store[prep.ids[n]] is not None}
        cycles = max(clocks)
        seconds = cycles / self.hz
        dyn = sum(sum(r.energy_pj.values()) for r in records) * 1e-12
        totals = {"cycles": cycles, "seconds": seconds, "energy_j": dyn, "instructions": len(records),
                  "host_partitions_s": host_s}
        return RunResult(outputs, records, captured, totals, kv, ctx.head_norms if prep.kv_outputs else None,
                         host_s, time.perf_counter() - t0)

    # ---------------------------------------------------------------------------------------------------------
    def _record(self, idx, mnem, symbol, attr, cost: OpCost, clocks, ctx) -> InstrRecord:
        q = 0 if mnem == "KVLD" else (2 if mnem == "KVEVICT" else 1)
        compute = cost.compute_s * self.hz
        memory = cost.memory_s * self.hz
        cycles = max(compute, memory) + cost.overhead_s * self.hz
        layer = attr.get("layer")
        if q == 0:
            start = clocks[0]  # the LOAD queue runs ahead: spilled rows do not depend on this token's compute
            clocks[0] = start + cycles
            ctx.load_ready[layer] = clocks[0]
        elif q == 2:
            start = max(clocks[2], clocks[1])
            clocks[2] = start + cycles
            ctx.store_ready = clocks[2]
        else:
            start = clocks[1]
            if mnem == "XL_VMATMUL_CAUSAL":
                start = max(start, ctx.load_ready.get(layer, 0.0))
            elif mnem == "KVAPPEND":
                start = max(start, ctx.store_ready)
            clocks[1] = start + cycles
        energy = {a: n * self.machine.energy[a].pj for a, n in cost.counts.items() if n}
        energy["static"] = self.machine.power.static_w * cycles / self.hz * 1e12
        return InstrRecord(idx, mnem, QUEUES[q], symbol, layer, start, cycles, compute, memory, cost.bound, energy)


class _RunContext:
    """Per-call state: the KV cache, the head mask, attention bookkeeping, and the op semantics + costs."""

    def __init__(self, emu: Emulator, kv: KVCache | None, mask: np.ndarray | None):
        self.emu, self.kv, self.mask = emu, kv, mask
        self.load_ready: dict = {}
        self.store_ready = 0.0
        self.head_norms = np.full((emu.layers, emu.heads), np.nan, np.float32) if emu.layers else None
        self.ctx_len: dict[int, tuple[int, int]] = {}
        m = emu.machine
        self.v = m.vector

    def active(self, layer: int | None) -> np.ndarray | None:
        if self.mask is None or layer is None:
            return None
        return self.mask[layer]

    def _cost(self, key, make) -> OpCost:
        c = self.emu._cost_cache.get(key)
        if c is None:
            c = self.emu._cost_cache[key] = make()
        return c

    def _vector(self, kind, layer, elements, ops, extra=None) -> OpCost:
        def make():
            b = self.emu._builders["int4"]
            b.vector(kind, kind, layer, float(elements), float(ops), extra)
            return b.ops.pop()
        return self._cost(("v", kind, layer, elements, ops, tuple(sorted((extra or {}).items()))), make)

    def execute(self, mnem: str, attr: dict, ins: list, bound):
        layer = attr.get("layer")
        emu, v = self.emu, self.v
        if "op" in attr:
            return self._generic(attr, ins, layer)
        if mnem.startswith("XL_GEMM"):
            gemm, bias = bound
            x = ins[0]
            if "im2col" in attr:
                kh, kw = attr["im2col"]
                n_, c, h, w_ = x.shape
                x = x.reshape(n_, c, h // kh, kh, w_ // kw, kw).transpose(0, 2, 4, 1, 3, 5).reshape(
                    n_, (h // kh) * (w_ // kw), c * kh * kw)
            k, n = attr["k"], attr["n"]
            col_mask, frac = None, 1.0
            act = self.active(layer)
            role = attr.get("head_role")
            if act is not None and role and emu.head_dim:
                frac = float(act.mean())
                if role == "q_proj":
                    col_mask = np.repeat(act, emu.head_dim).astype(np.float32)
                else:  # o_proj rows of skipped heads: their input is exactly zero already
                    pass
            y = gemm(x, col_mask)
            if bias is not None:
                y = y + bias
            if "im2col" in attr:
                y = y.reshape(x.shape[0], h // kh, w_ // kw, n).transpose(0, 3, 1, 2)
            rows = int(np.prod(x.shape[:-1]))
            dtype = {16: "fp16", 8: "int8", 4: "int4"}[attr["bits"]]
            kk, nn = (k * frac, n) if role == "o_proj" else (k, n * frac if role == "q_proj" else n)

            def make():
                b = emu._builders[dtype]
                b.matmul(attr["weight"], "gemm", layer, kk, nn, 0.0, rows=rows)
                return b.ops.pop()
            return [y], self._cost(("g", attr["weight"], rows, kk, nn), make)
        if mnem == "VRMSNORM":
            x = ins[0]
            ms = np.mean(x * x, axis=-1, keepdims=True)
            y = x * (np.float32(1.0) / np.sqrt(ms + np.float32(attr["eps"]))) * bound
            return [y], self._vector("rmsnorm", layer, x.size, v.rmsnorm_ops)
        if mnem == "VSILU_MUL":
            g, u = ins
            y = g / (np.float32(1.0) + np.exp(-g)) * u
            return [y], self._vector("silu_mul", layer, g.size, v.silu_mul_ops)
        if mnem == "VGELU":
            x = ins[0]
            y = x * np.float32(0.5) * (erf(x * np.float32(1.0 / math.sqrt(2.0))) + np.float32(1.0))
            return [y], self._vector("gelu", layer, x.size, v.silu_mul_ops)
        if mnem == "XL_ROPE_ROTATE":
            x, cos, sin = ins
            half = x.shape[-1] // 2
            rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            y = x * cos + rot * sin
            frac = 1.0
            act = self.active(layer)
            if act is not None and attr.get("role") == "q":
                frac = float(act.mean())
            return [y], self._vector("rope", layer, x.size * frac, v.rope_ops)
        if mnem == "KVEVICT":
            k = ins[0]
            res, _ = self.kv.length(layer)
            evicted = max(0, min(res, res + k.shape[2] - self.kv.window))
            if not evicted:
                return [], None  # predicated off: the window still has room
            ebits = evicted * 2 * k.shape[0] * k.shape[1] * k.shape[3] * emu.machine.kv_bits
            return [], self._vector("kv_evict", layer, 0, 1, {"sram_read_bit": ebits, "dram_write_bit": ebits,
                                                              "_kv_sram_bits": ebits})
        if mnem == "KVAPPEND":
            k, val = ins
            self.kv.append(layer, k, val)
            values = 2 * k.size
            bits = values * emu.machine.kv_bits
            return [], self._vector("kv_append", layer, values, v.quantize_ops,
                                    {"sram_write_bit": bits, "_kv_sram_bits": bits})
        if mnem == "KVLD":
            res, dram = self.kv.length(layer)
            self.ctx_len[layer] = (res, dram)
            if not dram:
                return [], None
            act = self.active(layer)
            groups = emu.kv_heads if act is None else int(act.reshape(emu.kv_heads, -1).any(1).sum())
            b_ = self.kv.res[layer][0].shape[0]
            bits = groups * dram * emu.head_dim * emu.machine.kv_bits * 2 * b_
            return [], self._vector("kv_load", layer, 0, 1, {"dram_read_bit": bits, "sram_write_bit": bits})
        if mnem == "XL_VMATMUL_CAUSAL":
            return self._scores(attr, ins, layer)
        if mnem == "VSOFTMAX" and attr.get("attn"):
            s = ins[0]
            p = softmax(s)
            amax = p.max(axis=-1, keepdims=True)
            p_s = amax / np.float32(127.0)
            p_int = np.rint(p / np.where(p_s == 0, np.float32(1.0), p_s))
            return [(p_int, p_s)], self._vector("softmax", layer, s.size * self._frac(layer), v.softmax_ops)
        if mnem == "XL_VMATMUL_PV":
            return self._pv(attr, ins, layer)
        if mnem == "HOSTCALL":
            sess, part = bound
            outs = sess.run(part["outputs"], dict(zip(part["inputs"], ins)))
            return outs, self._vector("hostcall", layer, 0, 1)
        raise EmulatorError(f"instruction {mnem} has no semantics in this emulator")

    def _generic(self, attr, ins, layer):
        """The one-to-one lowering: numpy semantics of the ONNX op, vector or layout costs."""
        emu, v = self.emu, self.v
        op = attr["op"]
        a = attr["attrs"]
        if op == "Concat":
            y = [np.concatenate(ins, axis=a.get("axis", 0))]
        else:
            r = GENERIC_FN[op](*ins, **a)
            y = list(r) if op in _MULTI_OUT else [r]
            if op not in ("Shape", "Range", "Cast") and isinstance(y[0], np.ndarray) and y[0].dtype == np.float64:
                y = [y[0].astype(np.float32)]
        if op in FREE_OPS:
            return y, None
        out = y[0]
        size = int(np.size(out))
        if op == "MatMul":  # activation x activation (vision attention): attention-engine MACs
            macs = float(np.prod(ins[0].shape)) * ins[1].shape[-1]

            def make():
                b = emu._builders["fp16"]
                b.vector("matmul", "matmul", layer, size, 1.0,
                         {"mac_fp16": macs})
                c = b.ops.pop()
                c.compute_s = macs / (emu.machine.sram.kv_banks * emu.machine.attention.macs_per_kv_bank) / emu.hz
                return c
            return y, self._cost(("mm", layer, ins[0].shape, ins[1].shape), make)
        ops = {"Softmax": v.softmax_ops, "LayerNormalization": v.rmsnorm_ops}.get(op, v.residual_ops)
        return y, self._vector(op, layer, size, ops)

    def _frac(self, layer) -> float:
        act = self.active(layer)
        return 1.0 if act is None else float(act.mean())

    def _kv_group_view(self, x: np.ndarray) -> np.ndarray:
        b, h, s, d = x.shape
        return x.reshape(b, self.emu.kv_heads, h // self.emu.kv_heads, s, d)

    def _scores(self, attr, ins, layer):
        emu = self.emu
        q, mask = ins
        kq, ks, _, _ = self.kv.full(layer)  # (b, kv, T, hd) int8, (b, kv, T, G) f16
        qg = self._kv_group_view(q)  # (b, kv, g, s, hd)
        q_int, q_s = quantize_rows_int8(qg)  # per head row
        group = self.kv.group
        G = kq.shape[-1] // group
        kf = kq.astype(np.float32)
        ksf = ks.astype(np.float32)
        if G == 1:
            s = np.matmul(q_int, kf[:, :, None].swapaxes(-1, -2)) * ksf[:, :, None, None, :, 0]
        else:
            s = 0
            for j in range(G):
                sl = slice(j * group, (j + 1) * group)
                s = s + np.matmul(q_int[..., sl], kf[:, :, None, :, sl].swapaxes(-1, -2)) * ksf[:, :, None, None, :, j]
        s = s * q_s / np.float32(attr["scale"]) + mask
        act = self.active(layer)
        res, dram = self.kv.length(layer)
        t = res + dram
        rows = q.shape[2] * q.shape[0]
        heads_active = emu.heads * self._frac(layer)
        groups_active = emu.kv_heads if act is None else int(act.reshape(emu.kv_heads, -1).any(1).sum())
        return [s], self._attn_cost("attn_scores", layer, heads_active, groups_active, t, rows)

    def _attn_cost(self, kind, layer, heads_active, groups_active, t, rows):
        emu = self.emu

        def make():
            b = emu._builders["int4"]
            avg = max(1, int(round(t - (rows - 1) / 2)))  # causal: query rows see on average this many keys
            b.attention_matmul(kind, kind, layer, heads_active, groups_active, emu.head_dim,
                               KvPlacement(emu.kv_bytes_per_token, emu.window, avg, 0))
            c = b.ops.pop()
            if rows > 1:
                c.counts = {a: n * rows for a, n in c.counts.items()}
                c.compute_s *= rows
                c.memory_s *= rows
                c.energy_j = sum(n * emu.machine.energy[a].pj for a, n in c.counts.items()) * 1e-12
            return c
        return self._cost(("att", kind, layer, heads_active, groups_active, t, rows), make)

    def _pv(self, attr, ins, layer):
        emu = self.emu
        p_int, p_s = ins[0]
        _, _, vq, vs = self.kv.full(layer)
        v = dequantize_groups(vq, vs, self.kv.group)  # v_int * v_s16 per row and group, FP32
        o = np.matmul(p_int, v[:, :, None]) * p_s  # (b, kv, g, s, hd)
        act = self.active(layer)
        if act is not None:
            o = o * act.reshape(1, emu.kv_heads, -1, 1, 1)
        o = to_fp16(o)
        norms = np.linalg.norm(o[0, :, :, -1, :], axis=-1).reshape(-1)
        if act is None:
            self.head_norms[layer] = norms
        else:
            self.head_norms[layer] = np.where(act, norms, np.nan)
        res, dram = self.kv.length(layer)
        rows = o.shape[3] * o.shape[0]
        heads_active = emu.heads * self._frac(layer)
        groups_active = emu.kv_heads if act is None else int(act.reshape(emu.kv_heads, -1).any(1).sum())
        return [o], self._attn_cost("attn_values", layer, heads_active, groups_active, res + dram, rows)
