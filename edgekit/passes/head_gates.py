"""Learned head gates beside a LoRA adapter (`head_gates.json`, written by `edgekit finetune`), folded without torch.

In training each head's share of `o_proj`'s input was scaled by its gate, so the model computed
`(W + dW) diag(g) x`. Folding is that product: after the LoRA merge, `o_proj`'s input columns (the (out, in)
layout; rows when the graph stores (in, out)) are scaled by `g` repeated over the head's dims. A closed head
(g = 0) then adds exactly nothing, and the gates become the bundle's head importance for the X1's DSS.

Checked before anything changes, like the adapter itself: the file's schema, every layer's `o_proj` present in
the model, and its input width equal to heads x head_dim.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from edgekit.ir_values import const_array
from edgekit.names import HEAD_GATES_FILE

from .peft_adapter import AdapterError

if TYPE_CHECKING:  # lora imports this module
    from .lora import WeightSlot


@dataclass(frozen=True)
class GateLayer:
    module: str  # the attention module, e.g. `model.layers.0.self_attn`; its `o_proj` is scaled
    gates: np.ndarray  # (heads,) in [0, 1]
    head_dim: int


@dataclass(frozen=True)
class HeadGateFile:
    path: Path
    doc: dict
    layers: tuple[GateLayer, ...]

    @property
    def closed(self) -> int:
        return int(sum((layer.gates == 0).sum() for layer in self.layers))


def read_head_gates(adapter_dir: str | Path) -> HeadGateFile | None:
    """The gates beside an adapter, or None when it has none; every schema problem is reported together."""
    path = Path(adapter_dir) / HEAD_GATES_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        entries = doc["layers"]
        if not isinstance(entries, list) or not entries:
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise AdapterError("head gates unreadable: expected JSON with a non-empty 'layers' list", path) from None
    problems, layers = [], []
    for i, e in enumerate(entries):
        score = e.get("score") if isinstance(e, dict) else None
        module, hd = (e.get("module"), e.get("head_dim")) if isinstance(e, dict) else (None, None)
        if not isinstance(module, str) or not isinstance(hd, int) or hd < 1 or not isinstance(score, list):
            problems.append(f"layer {i}: needs 'module' (string), 'head_dim' (int >= 1) and 'score' (list)")
            continue
        g = np.asarray(score, dtype=np.float64)
        if g.ndim != 1 or not g.size or not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in g):
            problems.append(f"layer {i}: gates must be numbers in [0, 1]")
            continue
        layers.append(GateLayer(module, g.astype(np.float32), hd))
    if problems:
        raise AdapterError("head gates do not fit the schema", path, problems=problems)
    return HeadGateFile(path, doc, tuple(layers))


def plan_gate_fold(
    gates: HeadGateFile, slots: Mapping[str, WeightSlot], module_prefix: str = ""
) -> list[tuple[WeightSlot, np.ndarray]]:
    """(o_proj weight slot, per-input-column scale) per layer; one `AdapterError` for everything that misfits."""
    plan: list[tuple[WeightSlot, np.ndarray]] = []
    problems: list[str] = []
    for layer in gates.layers:
        name = f"{module_prefix}{layer.module}.o_proj"
        slot = slots.get(name)
        width = layer.gates.size * layer.head_dim
        if slot is None:
            problems.append(f"{name} has no weight MatMul in the model")
        elif slot.shape_out_in[1] != width:
            problems.append(f"{name} takes {slot.shape_out_in[1]} inputs, the gates cover {width}")
        else:
            plan.append((slot, np.repeat(layer.gates, layer.head_dim)))
    if problems:
        raise AdapterError(
            f"{len(problems)} gated layer(s) do not fit the model; nothing was merged", gates.path, problems=problems
        )
    return plan


def fold_gates(model: ir.Model, entries: list[tuple[WeightSlot, np.ndarray]]) -> list[str]:
    """Scale each planned `o_proj` weight's input side in place; returns the initializers changed."""
    touched = []
    for slot, scale in entries:
        value = model.graph.initializers[slot.initializer]
        w = const_array(value)
        folded = w * (scale[None, :] if slot.out_in else scale[:, None])
        value.const_value = ir.Tensor(folded.astype(w.dtype), name=slot.initializer)
        touched.append(slot.initializer)
    return touched


def importance_doc(gates: HeadGateFile) -> dict:
    """The gates as the bundle's `head_importance.json` (DSS reads `score` as g[l, h])."""
    return {**gates.doc, "source_file": gates.path.name}
