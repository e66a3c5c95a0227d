"""One program bound for execution: its steps in order, the tensor table's initial contents, and the memo of
its input-determined steps.

Why bound once: at load each instruction becomes a closure (`binder.Binder`) with operands, prepared weights
and attributes resolved, so a run is a loop over `Step`s with no per-call decoding. Why a memo: the causal mask
and the RoPE tables depend only on the call's integer inputs and input shapes, so a call that repeats a key
(the same positions in the next report) replays their outputs and cost entries, in program order.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from .binder import Binder
from .program import Program

if TYPE_CHECKING:
    from .bind_env import BindEnv


class Step:
    """One bound instruction: `fn(store, ctx) -> Entry | None` does the work and names its cost. `mode` folds
    the queue and the dependency wait into one small int for the run loop; `static` is the step's index among
    the program's input-determined steps (`Prepared`), or -1."""

    __slots__ = ("fn", "index", "mnemonic", "queue", "wait", "layer", "symbol", "out_ids", "mode", "static")

    def __init__(self, fn, index, mnemonic, queue, wait, layer, symbol, out_ids):
        self.fn, self.index, self.mnemonic, self.queue, self.wait = fn, index, mnemonic, queue, wait
        self.layer, self.symbol, self.out_ids = layer, symbol, out_ids
        self.mode = MODE_LOAD_QUEUE if queue == 0 else MODE_STORE_QUEUE if queue == 2 else MODE_COMPUTE + wait
        self.static = -1


WAIT_NONE, WAIT_LOAD, WAIT_STORE = 0, 1, 2
MODE_COMPUTE, MODE_COMPUTE_AFTER_LOAD, MODE_COMPUTE_AFTER_STORE, MODE_LOAD_QUEUE, MODE_STORE_QUEUE = 0, 1, 2, 3, 4
_INT_DTYPES = {2, 3, 4, 5, 6, 7, 9, 12, 13}  # ONNX uint8 int8 uint16 int16 int32 int64 bool uint32 uint64


class Prepared:
    """One program bound for execution: its steps, the tensor table's initial contents, and its I/O."""

    def __init__(self, name: str, program: Program, env: BindEnv):
        self.name, self.program = name, program
        plan = program.memory_plan["tensors"]
        self.ids = {t["name"]: i for i, t in enumerate(plan)}
        self.n_tensors = len(plan)
        self.preload: dict[int, np.ndarray] = {}
        self.steps: list[Step] = []
        binder = Binder(env, program)
        for idx, ins in enumerate(program.instructions):
            if ins.mnemonic == "END":
                continue
            attr = program.attrs[ins.operands[0]]
            for cname, key in attr.get("const", {}).items():
                self.preload[self.ids[cname]] = np.asarray(program.weights[key])
            mnem = ins.mnemonic
            queue = 0 if mnem == "KVLD" else (2 if mnem == "KVEVICT" else 1)
            wait = WAIT_LOAD if mnem == "XL_VMATMUL_CAUSAL" else (WAIT_STORE if mnem == "KVAPPEND" else WAIT_NONE)
            self.steps.append(
                Step(
                    binder.bind(mnem, attr),
                    idx,
                    mnem,
                    queue,
                    wait,
                    attr.get("layer"),
                    program.symbols.get(idx, ""),
                    tuple(attr["out_ids"]),
                )
            )
        self.base_store: list = [None] * self.n_tensors
        for i, a in self.preload.items():
            self.base_store[i] = a
        self.inputs = [i["name"] for i in program.io["inputs"]]
        self.outputs = [o["name"] for o in program.io["outputs"]]
        self.kv_outputs = {int(k): v for k, v in program.io.get("kv_outputs", {}).items()}
        self.static_steps: list[Step] = []
        self.key_values: list[str] = []
        self.key_shapes: list[str] = []
        self._find_static_steps(program)
        self.memo: dict[tuple, tuple[list, list]] = {}
        self._memo_sizes: dict[tuple, int] = {}
        self.memo_bytes = 0
        self._memo_lock = threading.Lock()
        self.plan = [(st.fn, st.static, st.mode, st) for st in self.steps]  # what the run loop unpacks per step
        # a program of gathers and vector ops (embed_tokens) never calls BLAS: no thread limit to set per run
        self.uses_blas = any(st.mnemonic.startswith("XL_") or st.mnemonic == "HOSTCALL" for st in self.steps)

    MEMO_KEYS, MEMO_BYTES = 256, 16 << 20

    def _find_static_steps(self, program: Program) -> None:
        """Steps whose outputs are a function of the call's integer inputs (values) and its inputs' shapes alone:
        the decoder's causal mask and RoPE tables (Shape, Range, Where, Cos, Sin, ... over attention_mask and
        position_ids). Their outputs and cost entries are memoised per such key (`memo`), so a call whose key was
        seen before (the same positions and mask in another report) replays them instead of recomputing."""
        dtypes = {i["name"]: int(i["dtype"]) for i in program.io["inputs"]}
        names = {i: n for n, i in self.ids.items()}
        known = set(self.preload)
        values, shapes = set(), set()
        returned = {self.ids[o] for o in self.outputs if o in self.ids}  # handed to the caller: never shared
        for st in self.steps:
            attr = program.attrs[program.instructions[st.index].operands[0]]
            op = attr.get("op")
            if op is None or op == "MatMul" or returned.intersection(st.out_ids):
                continue
            need_v, need_s = set(), set()
            for i in attr["in_ids"]:
                name = names[i]
                if i in known:
                    continue
                if name in dtypes and op == "Shape":
                    need_s.add(name)
                elif name in dtypes and dtypes[name] in _INT_DTYPES:
                    need_v.add(name)
                else:
                    break
            else:
                st.static = len(self.static_steps)
                self.static_steps.append(st)
                known.update(st.out_ids)
                values |= need_v
                shapes |= need_s
        self.key_values, self.key_shapes = sorted(values), sorted(shapes)

    def memo_key(self, store: list) -> tuple:
        ids = self.ids
        key: list[tuple] = [(n, store[ids[n]].shape) for n in self.key_shapes]
        for n in self.key_values:
            a = store[ids[n]]
            key.append((n, a.shape, a.dtype.str, a.tobytes()))
        return tuple(key)

    def remember(self, key: tuple, store: list, entries: list) -> None:
        """Keep one key's static outputs and cost entries; the oldest keys go first past `MEMO_KEYS` keys or
        `MEMO_BYTES` of arrays (a decode step's entry is a few KiB, a long prefill's causal mask more)."""
        outs = [(i, store[i]) for st in self.static_steps for i in st.out_ids]
        size = sum(getattr(a, "nbytes", 0) for _, a in outs)
        with self._memo_lock:  # runs of one program may come from several threads
            self._remember(key, outs, entries, size)

    def _remember(self, key: tuple, outs: list, entries: list, size: int) -> None:
        while self.memo and (len(self.memo) >= self.MEMO_KEYS or self.memo_bytes + size > self.MEMO_BYTES):
            oldest = next(iter(self.memo))
            del self.memo[oldest]
            self.memo_bytes -= self._memo_sizes.pop(oldest)
        if size <= self.MEMO_BYTES:
            self.memo[key] = (outs, entries)
            self._memo_sizes[key] = size
            self.memo_bytes += size
