"""Per-layer accuracy analysis of the X1 against ONNX Runtime FP32: cosine similarity and SNR (dB) per layer.

Two modes, as RKNN-Toolkit2's accuracy analysis has:
- "entire": both sides run the whole graph on the same inputs and every layer's outputs are compared, so errors
  accumulate from layer to layer (what a user's output actually sees).
- "single": each layer is fed the *reference* values of its inputs, so a layer's figure is its own error only
  and a bad layer stands out even in the middle of a deep model.

A "layer" is a group of ONNX nodes named alike: everything under `.../layers.N/` is layer N of its stack
(`/model/layers.3`, `/vision_model/encoder/layers.0`); other nodes group by module (`/model/norm`, `/lm_head`,
`/connector`). A layer's inputs are the values it reads that another layer produced (graph inputs, initializers
and Constant outputs are the same on both sides); its outputs are the values it produces that something outside
it reads, or that are graph outputs.

How the device side is driven: a runner is anything with `run(feeds, capture, overrides) -> {name: array}`.
`OrtRunner` runs a copy of the ONNX graph with the captured values added as extra graph outputs and each
overridden value turned into a graph input (its producer's result is dropped). `EmulatorRunner` calls
`Emulator.run(graph, feeds, capture=..., overrides=...)`: the emulator substitutes each overridden ONNX value for
its own result of that value (the instruction producing it still runs; its output is replaced before any consumer
reads it), and `capture` returns the emulator's value of each layer output. The reference values come from ORT on
the same graph (or another FP32 graph with the same value names: the unquantised export, for instance).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from edgekit.errors import ConfigError, EdgekitError

MODES = ("entire", "single")
_LAYER = re.compile(r"layers\.\d+")
_CONTAINERS = {"model", "vision_model", "language_model", "encoder", "decoder"}


# ------------------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------------------
def cosine(ref: np.ndarray, test: np.ndarray) -> float:
    """Cosine similarity of the flattened tensors; 1.0 when both are zero."""
    a, b = np.asarray(ref, np.float64).ravel(), np.asarray(test, np.float64).ravel()
    if np.array_equal(a, b):
        return 1.0  # exactly: rounding in the norms would make equal tensors look 1e-16 apart
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.clip(a @ b / (na * nb), -1.0, 1.0))


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """10 log10(signal power / error power); inf when the tensors are equal."""
    a, b = np.asarray(ref, np.float64).ravel(), np.asarray(test, np.float64).ravel()
    err = float(np.sum((a - b) ** 2))
    if err == 0:
        return math.inf
    sig = float(np.sum(a**2))
    return 10 * math.log10(sig / err) if sig > 0 else -math.inf


# ------------------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Layer:
    name: str
    nodes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def layer_key(node_name: str) -> str | None:
    """The layer a node belongs to, from its name (see the module docstring); None for unnamed nodes."""
    parts = [p for p in node_name.split("/") if p]
    if not parts:
        return None
    for i, p in enumerate(parts[:-1]):
        if _LAYER.fullmatch(p):
            return "/" + "/".join(parts[: i + 1])
    module = parts[:-1] or parts
    depth = 1
    while depth < len(module) and module[depth - 1] in _CONTAINERS:
        depth += 1
    return "/" + "/".join(module[:depth])


def find_layers(model: onnx.ModelProto) -> list[Layer]:
    """The model's layers in graph order, with their boundary values."""
    g = model.graph
    fixed = {i.name for i in g.initializer} | {i.name for i in g.input}
    fixed |= {o for n in g.node if n.op_type == "Constant" for o in n.output}
    graph_outputs = {o.name for o in g.output}
    layers: dict[str, Layer] = {}
    owner: dict[str, str] = {}
    for n in g.node:
        if n.op_type == "Constant":
            continue
        key = layer_key(n.name) or f"/{n.op_type}"
        layers.setdefault(key, Layer(key)).nodes.append(n.name)
        for o in n.output:
            owner[o] = key
    readers: dict[str, set[str]] = {}
    for n in g.node:
        if n.op_type == "Constant":
            continue
        key = layer_key(n.name) or f"/{n.op_type}"
        for i in n.input:
            if i and i not in fixed:
                readers.setdefault(i, set()).add(key)
                if owner.get(i, key) != key and i not in layers[key].inputs:
                    layers[key].inputs.append(i)
    for value, key in owner.items():
        if value in graph_outputs or readers.get(value, set()) - {key}:
            layers[key].outputs.append(value)
    return [L for L in layers.values() if L.outputs]


# ------------------------------------------------------------------------------------------------------------
# runners
# ------------------------------------------------------------------------------------------------------------
_ORT_ELEM = {
    np.dtype(np.float32): onnx.TensorProto.FLOAT,
    np.dtype(np.float16): onnx.TensorProto.FLOAT16,
    np.dtype(np.int64): onnx.TensorProto.INT64,
    np.dtype(np.int32): onnx.TensorProto.INT32,
    np.dtype(np.bool_): onnx.TensorProto.BOOL,
}


class OrtRunner:
    """ONNX Runtime FP32 on a copy of a graph, exposing any intermediate value and taking any value as input."""

    def __init__(self, model: onnx.ModelProto | str | Path):
        self.model = onnx.load(str(model)) if not isinstance(model, onnx.ModelProto) else model
        self._sessions: dict = {}

    def _session(self, capture: tuple[str, ...], overrides: tuple[tuple[str, np.dtype, tuple], ...]):
        import onnxruntime as ort

        key = (capture, overrides)
        if key in self._sessions:
            return self._sessions[key]
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        g = m.graph
        for name, dtype, shape in overrides:  # the producer keeps running; its result goes nowhere
            for n in g.node:
                for i, o in enumerate(n.output):
                    if o == name:
                        n.output[i] = f"{name}__replaced"
            g.input.append(helper.make_tensor_value_info(name, _ORT_ELEM[np.dtype(dtype)], list(shape)))
        present = {o.name for o in g.output}
        for name in capture:
            if name not in present:
                g.output.append(onnx.ValueInfoProto(name=name))  # untyped: ORT takes the producer's type
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every value as written
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self._sessions[key] = sess
        return sess

    def run(
        self, feeds: Mapping[str, np.ndarray], capture, overrides: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        overrides = dict(overrides or {})
        ov = tuple(sorted((k, np.asarray(v).dtype, np.asarray(v).shape) for k, v in overrides.items()))
        capture = tuple(sorted(set(capture)))
        sess = self._session(capture, ov)
        wanted = {i.name for i in sess.get_inputs()}
        allfeeds = {k: v for k, v in {**feeds, **overrides}.items() if k in wanted}
        return dict(zip(capture, sess.run(list(capture), allfeeds)))


class EmulatorRunner:
    """The X1 emulator on one graph, through `Emulator.run(graph, feeds, capture=..., overrides=...)`.

    Overrides (single mode) use the emulator's public `overrides` argument: an instruction producing an
    overridden ONNX value hands the reference value (cast to the dtype the emulator stores it in) to its
    consumers instead of its own. A value the program does not materialise (fused away) or keeps quantised cannot
    be substituted; those are listed in `last_not_substituted`."""

    def __init__(self, emulator, graph: str):
        self.emulator, self.graph = emulator, graph
        self.last_not_substituted: list[str] = []

    def run(
        self, feeds: Mapping[str, np.ndarray], capture, overrides: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        result = self.emulator.run(
            self.graph, dict(feeds), capture=set(capture), overrides=dict(overrides) if overrides else None
        )
        done = set(getattr(result, "overridden", []) or [])
        self.last_not_substituted = sorted(n for n in (overrides or {}) if n not in done)
        got = dict(getattr(result, "captured", {}) or {})
        for name, value in (getattr(result, "outputs", {}) or {}).items():
            got.setdefault(name, value)
        return got


# ------------------------------------------------------------------------------------------------------------
# the analysis
# ------------------------------------------------------------------------------------------------------------
@dataclass
class LayerAccuracy:
    layer: str
    cosine: float  # worst over the layer's float outputs
    snr_db: float  # worst over the layer's float outputs
    max_abs_err: float
    worst_value: str
    values: int
    flagged: bool = False
    missing: list[str] = field(default_factory=list)  # outputs the device side did not return

    def to_dict(self) -> dict:
        d = asdict(self)
        d["snr_db"] = _json_float(self.snr_db)
        return d


def _json_float(x: float):
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


@dataclass
class AccuracyReport:
    graph: str
    mode: str
    layers: list[LayerAccuracy]
    flag_below_db: float

    @property
    def flagged(self) -> list[str]:
        return [L.layer for L in self.layers if L.flagged]

    def to_dict(self) -> dict:
        return {
            "graph": self.graph,
            "mode": self.mode,
            "flag_below_db": self.flag_below_db,
            "flagged": self.flagged,
            "layers": [L.to_dict() for L in self.layers],
            "source": f"edgekit x1 accuracy analysis ({self.mode}): device vs ONNX Runtime FP32, "
            "worst cosine and SNR over each layer's outputs",
        }

    def table(self) -> list[dict]:
        return [
            {
                "layer": L.layer,
                "cosine": round(L.cosine, 6),
                "snr_db": _json_float(round(L.snr_db, 2)),
                "flag": "<-- " if L.flagged else "",
            }
            for L in self.layers
        ]


def _compare(layer: Layer, ref: Mapping, dev: Mapping, flag_below_db: float) -> LayerAccuracy:
    worst = (1.0, math.inf, 0.0, "")
    n, missing = 0, []
    for v in layer.outputs:
        r = ref.get(v)
        if r is None or not np.issubdtype(np.asarray(r).dtype, np.floating):
            continue
        d = dev.get(v)
        if d is None:
            missing.append(v)
            continue
        r, d = np.asarray(r, np.float64), np.asarray(d, np.float64)
        if r.shape != d.shape:
            raise EdgekitError(
                f"accuracy analysis: value {v!r} has shape {d.shape} on the device, {r.shape} in ONNX Runtime"
            )
        n += 1
        c, s = cosine(r, d), snr_db(r, d)
        err = float(np.max(np.abs(r - d))) if r.size else 0.0
        if s < worst[1] or (s == worst[1] and c < worst[0]):
            worst = (c, s, max(worst[2], err), v)
        else:
            worst = (worst[0], worst[1], max(worst[2], err), worst[3])
    c, s, err, v = worst
    return LayerAccuracy(layer.name, c, s, err, v, n, flagged=bool(n) and s < flag_below_db, missing=missing)


def analyze(
    model: onnx.ModelProto | str | Path,
    device,
    feeds: Mapping[str, np.ndarray],
    *,
    mode: str = "entire",
    reference=None,
    graph: str = "",
    flag_below_db: float = 15.0,
) -> AccuracyReport:
    """Compare `device` (a runner) with ONNX Runtime FP32 on `model`, layer by layer.

    `reference`: the reference runner (default: `OrtRunner(model)`); `flag_below_db`: a layer whose worst SNR
    is below this is flagged (15 dB: INT4 KV rows alone measure ~20 dB, so a flag means more than the
    designed quantisation error)."""
    if mode not in MODES:
        raise ConfigError(f"accuracy analysis mode {mode!r} (expected one of {', '.join(MODES)})")
    proto = onnx.load(str(model)) if not isinstance(model, onnx.ModelProto) else model
    ref_runner = reference if reference is not None else OrtRunner(proto)
    layers = find_layers(proto)
    if not layers:
        raise EdgekitError("accuracy analysis: the graph has no layers to compare", graph or None)
    boundary = sorted({v for L in layers for v in (*L.inputs, *L.outputs)})
    ref = ref_runner.run(feeds, boundary)
    rows = []
    if mode == "entire":
        dev = device.run(feeds, [v for L in layers for v in L.outputs])
        rows = [_compare(L, ref, dev, flag_below_db) for L in layers]
    else:
        for L in layers:
            dev = device.run(feeds, L.outputs, {v: ref[v] for v in L.inputs})
            rows.append(_compare(L, ref, dev, flag_below_db))
    return AccuracyReport(graph or proto.graph.name, mode, rows, flag_below_db)


def decoder_prefill_feeds(
    model: onnx.ModelProto, *, seq: int = 16, seed: int = 0, embeddings: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Feeds for a decoder prefill: `embeddings` (1, seq, hidden) or unit-normal ones scaled like token
    embeddings (0.02 std would vanish in RMSNorm-free paths; the exported table's scale is used when given)."""
    import onnx_ir as ir

    from edgekit.passes.heads import decoder_feeds

    if embeddings is None:
        hidden = model.graph.input[0].type.tensor_type.shape.dim[-1].dim_value
        embeddings = np.random.default_rng(seed).standard_normal((1, seq, hidden)).astype(np.float32)
    return decoder_feeds(np.asarray(embeddings, np.float32), ir.from_proto(model))
