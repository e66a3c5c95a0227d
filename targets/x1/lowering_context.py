"""What a lowering pattern (`lower_attention`, `lower_matmul`, `lower_vector`) may use of the walk that calls it: the
graph, where its weights go, and how it emits instructions. A protocol, so the patterns never import `lowering`
(which imports them); `lowering.Lowering` is the one implementation."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnx_ir as ir

from .graph_view import GraphView


class LoweringContext(Protocol):
    g: GraphView
    graph_name: str
    kv_outputs: dict[int, tuple[str, str]]  # layer -> (present key, present value) value names

    def add_const(self, v: ir.Value, space: str = "ACT") -> str: ...

    def add_matrix_int(self, wname: str, q_kn: np.ndarray, scales_gn: np.ndarray, bits: int) -> dict: ...

    def add_matrix_f16(self, wname: str, w_kn: np.ndarray) -> dict: ...

    def emit(self, anchor: ir.Node, consumed: list[ir.Node], instrs: list[tuple[str, dict]], kind: str) -> None: ...
