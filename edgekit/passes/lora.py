"""LoRA merge into ONNX initializers, without torch: W' = W + sum_i weight_i * scaling_i * B_i @ A_i.

Why check everything first: the common failure with other tools is an adapter for a slightly different model
that fails late ("Invalid input name ...lora_A.weight") or, worse, half-merges. Here every adapter module is
mapped to a weight MatMul of the model and its (out, in) shape compared *before* any initializer changes; all
modules that do not fit are refused together in one `AdapterError`. A weighted sum of adapters is the exact sum
of their updates (what PEFT's `add_weighted_adapter(combination_type="cat")` merges to).

Layout: edgekit graphs keep `nn.Linear` weights (out, in) behind `Transpose -> MatMul`; a graph that feeds the
weight to MatMul directly holds it (in, out) (GPT-2 `Conv1D`, PEFT's `fan_in_fan_out=True`) and gets the
transposed update. The layout is read from the graph, so it cannot disagree with what the model computes.

An adapter written by `edgekit finetune` also holds learned head gates (`head_gates.json`): they are folded into
`o_proj` after the merge (`edgekit.passes.head_gates`) and become the bundle's head importance for the X1's DSS.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.ir_values import const_array
from edgekit.names import DECODER, HEAD_IMPORTANCE, HEAD_IMPORTANCE_FILE, VISION_ENCODER

from .base import ALL_GRAPHS, GraphPass, PassChanges, PassContext
from .config import PassConfig, param
from .head_gates import HeadGateFile, fold_gates, importance_doc, plan_gate_fold, read_head_gates
from .patterns import find_weight_matmuls
from .peft_adapter import AdapterError, PeftAdapter, read_peft_adapter


@dataclass
class LoraConfig(PassConfig):
    adapters: list[str] = param([], help="PEFT adapter directories (adapter_config.json + adapter_model.safetensors)")
    weights: list[float] = param([], help="one weight per adapter (default 1.0 each): W += sum w_i * delta_i")
    module_prefix: str = param(
        "", help="prepended to adapter module names, e.g. 'model.' for an adapter trained on the bare decoder"
    )

    def validate(self, where: str) -> None:
        if not self.adapters:
            raise ConfigError(f"{where}.adapters: at least one adapter directory is needed")
        if self.weights and len(self.weights) != len(self.adapters):
            raise ConfigError(f"{where}.weights: {len(self.weights)} weights for {len(self.adapters)} adapters")


@dataclass(frozen=True)
class WeightSlot:
    """Where a module's weight lives: its graph, initializer, and whether it is stored (out, in)."""

    graph: str
    initializer: str
    out_in: bool
    shape_out_in: tuple[int, int]


def weight_slots(model: ir.Model | onnx.ModelProto, graph: str) -> dict[str, WeightSlot]:
    """Module name -> weight slot for every MatMul fed by a constant 2-D weight."""
    if isinstance(model, onnx.ModelProto):  # sibling graphs are read without their weights
        model = ir.serde.deserialize_model(model)
    slots: dict[str, WeightSlot] = {}
    for mm in find_weight_matmuls(model):
        out_in = mm.transpose is not None
        slots.setdefault(mm.name, WeightSlot(graph, mm.weight_name, out_in, (mm.n, mm.k)))
    return slots


def plan_merge(
    adapters: list[tuple[PeftAdapter, float]], slots: dict[str, WeightSlot], module_prefix: str = ""
) -> dict[str, list[tuple[WeightSlot, object, float]]]:
    """Map every adapter module to a weight slot; raise one `AdapterError` listing every module that does not
    map or whose shape differs. Returns graph -> [(slot, LoraModule, adapter weight)]."""
    plan: dict[str, list] = {}
    problems = []
    for adapter, weight in adapters:
        for name, module in adapter.modules.items():
            target = module_prefix + name
            slot = slots.get(target)
            label = f"{adapter.path.name}:{target}"
            if slot is None:
                problems.append(f"{label} has no weight MatMul in the model (expected (out, in) {module.shape})")
            elif slot.shape_out_in != module.shape:
                problems.append(f"{label} expects (out, in) {module.shape}, the model has {slot.shape_out_in}")
            else:
                plan.setdefault(slot.graph, []).append((slot, module, weight))
    if problems:
        raise AdapterError(
            f"{len(problems)} adapter module(s) do not fit the model; nothing was merged", problems=problems
        )
    return plan


def apply_plan(model: ir.Model, entries: list) -> dict[str, float]:
    """Add each update to its initializer in place; returns initializer -> ||delta|| / ||W||."""
    deltas: dict[str, np.ndarray] = {}
    for slot, module, weight in entries:
        d = weight * module.delta().astype(np.float64)
        deltas[slot.initializer] = deltas.get(slot.initializer, 0.0) + (d if slot.out_in else d.T)
    rel = {}
    for name, delta in deltas.items():
        value = model.graph.initializers[name]
        w = const_array(value)
        merged = (w.astype(np.float64) + delta).astype(w.dtype)
        value.const_value = ir.Tensor(merged, name=name)
        rel[name] = float(np.linalg.norm(delta) / max(float(np.linalg.norm(w)), 1e-30))
    return rel


def load_adapters(config: LoraConfig) -> list[tuple[PeftAdapter, float]]:
    weights = config.weights or [1.0] * len(config.adapters)
    return [(read_peft_adapter(p), float(w)) for p, w in zip(config.adapters, weights)]


def load_gates(adapters: list[tuple[PeftAdapter, float]]) -> HeadGateFile | None:
    """The head gates of the one gated adapter, if any. Gates scale a head, they do not add: two gated adapters,
    or a gated one merged at a weight other than 1, have no meaning the training gave them, so they are refused."""
    gated = [(g, w) for a, w in adapters if (g := read_head_gates(a.path)) is not None]
    if len(gated) > 1:
        raise AdapterError(f"{len(gated)} adapters carry head gates; at most one can be merged")
    if gated and gated[0][1] != 1.0:
        raise AdapterError(
            f"an adapter with head gates merges at weight 1.0 only (got {gated[0][1]})", gated[0][0].path
        )
    return gated[0][0] if gated else None


def all_slots(model: ir.Model, ctx: PassContext) -> dict[str, WeightSlot]:
    """Weight slots of this graph, then of its siblings on disk (modules may live in another graph)."""
    slots = weight_slots(model, ctx.graph)
    if ctx.model_dir is not None:
        for g in ALL_GRAPHS:
            p = Path(ctx.model_dir) / g
            if g != ctx.graph and p.is_file():
                for k, v in weight_slots(onnx.load(str(p), load_external_data=False), g).items():
                    slots.setdefault(k, v)
    return slots


class LoraMergePass(GraphPass):
    """Merge PEFT LoRA adapters into the decoder (and vision encoder) weights."""

    name = "lora"
    Config = LoraConfig
    config: LoraConfig  # what GraphPass.__init__ checks it is
    graphs = (DECODER, VISION_ENCODER)

    def _plan(self, model: ir.Model, ctx: PassContext, adapters: list[tuple[PeftAdapter, float]]):
        """(LoRA updates, gate folds) for this graph; modules found in no graph of the model are errors."""
        slots = all_slots(model, ctx)
        merge = plan_merge(adapters, slots, self.config.module_prefix).get(ctx.graph, [])
        gates = load_gates(adapters)
        folds = plan_gate_fold(gates, slots, self.config.module_prefix) if gates is not None else []
        return merge, [(slot, scale) for slot, scale in folds if slot.graph == ctx.graph], gates

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        # refuses a misfitting adapter before the transform touches anything
        self._plan(model, ctx, load_adapters(self.config))

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        adapters = load_adapters(self.config)
        merge, folds, gates = self._plan(model, ctx, adapters)
        rel = apply_plan(model, merge)
        folded = fold_gates(model, folds)
        gate_notes = {}
        if folded:  # the graph holding the decoder's o_proj: the gates are its head importance
            gate_notes = {"head_gates": {"file": str(gates.path), "closed": gates.closed}}
            gate_notes[HEAD_IMPORTANCE] = importance_doc(gates)
        return PassChanges(
            initializers_touched=sorted({*rel, *folded}),
            notes={
                **gate_notes,
                "adapters": [
                    {
                        "path": a.path.name,
                        "weight": w,
                        "r": a.r,
                        "alpha": a.lora_alpha,
                        "rslora": a.use_rslora,
                        "modules": len(a.modules),
                    }
                    for a, w in adapters
                ],
                "relative_update": {k: round(v, 6) for k, v in sorted(rel.items())},
            },
        )


def merge_lora(
    model_dir: str | Path,
    out_dir: str | Path,
    adapters: list[str | Path],
    weights: list[float] | None = None,
    *,
    module_prefix: str = "",
) -> dict[str, dict[str, float]]:
    """Merge adapters into the graphs of `model_dir`, writing all graphs to `out_dir`.

    All-or-nothing: adapters are read and every module mapped before anything is written, and the output is
    assembled in a temporary sibling directory that is renamed into place only once complete. Returns
    graph -> initializer -> relative update norm. An adapter's head gates are folded, and written beside the
    graphs as `head_importance.json`.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    graphs = [g for g in ALL_GRAPHS if (model_dir / g).is_file()]
    if not graphs:
        raise ConfigError("no ONNX graphs found", model_dir)
    if out_dir.exists():
        raise ConfigError("output directory already exists; refusing to overwrite", out_dir)
    config = LoraConfig(adapters=[str(a) for a in adapters], weights=list(weights or []), module_prefix=module_prefix)
    config.validate("lora")
    loaded = load_adapters(config)
    gates = load_gates(loaded)
    models = {g: ir.load(model_dir / g) for g in graphs}
    slots: dict[str, WeightSlot] = {}
    for g, m in models.items():
        for k, v in weight_slots(m, g).items():
            slots.setdefault(k, v)
    plan = plan_merge(loaded, slots, module_prefix)  # raises before anything is written
    folds: dict[str, list] = {}
    for slot, scale in plan_gate_fold(gates, slots, module_prefix) if gates is not None else []:
        folds.setdefault(slot.graph, []).append((slot, scale))

    from edgekit.export.save import save_model

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        result = {}
        for g in graphs:
            if g in plan or g in folds:
                result[g] = apply_plan(models[g], plan.get(g, []))
                fold_gates(models[g], folds.get(g, []))
                save_model(models[g], tmp / g)
            else:
                for f in (g, g + ".data"):
                    if (model_dir / f).is_file():
                        shutil.copy2(model_dir / f, tmp / f)
        if gates is not None:
            (tmp / HEAD_IMPORTANCE_FILE).write_text(json.dumps(importance_doc(gates), indent=1) + "\n")
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
