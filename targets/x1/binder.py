"""Instruction -> closure: the dispatcher and the state the bind functions share.

Why closures: a run is a loop over them, each with its operand slots, prepared weights and attributes resolved
at load. What each instruction does lives with its unit: `bind_generic` (ONNX semantics, layout, host),
`bind_matrix` (GEMMs), `bind_vector` (norms, activations, RoPE), `bind_attention` (KV cache and attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import bind_attention, bind_generic, bind_matrix, bind_vector
from .bind_env import EmulatorError
from .kernels import IntGemm, unpack_int4_weight
from .program import Program

if TYPE_CHECKING:
    from .bind_env import BindEnv
    from .bind_matrix import FusedGemm


_MAKERS = {
    "VRMSNORM": bind_vector.rmsnorm,
    "VSILU_MUL": bind_vector.silu_mul,
    "VGELU": bind_vector.gelu,
    "XL_ROPE_ROTATE": bind_vector.rope,
    "KVEVICT": bind_attention.kv_evict,
    "KVAPPEND": bind_attention.kv_append,
    "KVLD": bind_attention.kv_load,
    "XL_VMATMUL_CAUSAL": bind_attention.scores,
    "XL_VMATMUL_PV": bind_attention.pv,
    "HOSTCALL": bind_generic.hostcall,
}


class Binder:
    """Builds each instruction's closure. Closures read operands from the run's tensor table (`store`, a list
    indexed by memory-plan tensor id) and the per-call state (`ctx`), write their outputs back, and return their
    cost entry (None: free, or predicated off)."""

    def __init__(self, env: BindEnv, program: Program):
        self.env, self.program = env, program
        self.costs, self.v = env.costs, env.machine.vector
        self.fused: dict[int, FusedGemm] = bind_matrix.fusable_gemms(self)
        self.signed_sin: list = [None]  # (sin array, its RoPE-signed copy): see `bind_vector.rope`
        readers: dict[int, int] = {}
        for ins in program.instructions:
            a = program.attrs[ins.operands[0]] if ins.mnemonic == "XL_GEMM.F16" else None
            if a is not None and "im2col" not in a:
                readers[a["in_ids"][0]] = readers.get(a["in_ids"][0], 0) + 1
        self.f16_shared = {i for i, n in readers.items() if n > 1}  # inputs read by several F16 GEMMs

    def int_gemm(self, attr) -> IntGemm:
        w, name = self.program.weights, attr["weight"]
        q = w[f"{name}.q"]
        codes = unpack_int4_weight(q, attr["k"]) if attr["bits"] == 4 else q.T.astype(np.float32)
        return IntGemm(codes, w[f"{name}.s"], attr["group"])

    def sized(self, kind, layer, ops):
        """A cost table for a vector op whose cost depends on its element count only."""
        costs, table = self.costs, {}

        def entry(size):
            e = table.get(size)
            if e is None:
                e = table[size] = costs.vector(kind, layer, size, ops)
            return e

        return entry

    def bind(self, mnem: str, attr: dict):
        ins, outs = tuple(attr["in_ids"]), tuple(attr["out_ids"])
        layer = attr.get("layer")
        if "op" in attr:
            return bind_generic.generic(self, attr, ins, outs, layer)
        if mnem.startswith("XL_GEMM"):
            return bind_matrix.gemm(self, mnem, attr, ins, outs, layer)
        maker = _MAKERS.get(mnem)
        if mnem == "VSOFTMAX" and attr.get("attn"):
            maker = bind_attention.attn_softmax
        if maker is None:

            def unknown(store, ctx):
                raise EmulatorError(f"instruction {mnem} has no semantics in this emulator")

            return unknown
        return maker(self, attr, ins, outs, layer)
