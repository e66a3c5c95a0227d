"""The contract every graph pass follows: a typed config, preconditions, a transform and a report.

Why a layer over `onnx_ir.passes`: onnx_ir gives the in-place/functional discipline (`PassResult(model,
modified)`), but edgekit also needs (1) configs that users type on the command line or in TOML, checked field by
field with errors naming the field, (2) preconditions that fail with an `EdgekitError` a user can act on rather
than a `PreconditionError` traceback, and (3) a `PassReport` that `edgekit build` stamps into bundle provenance.

Writing a pass::

    @dataclass
    class PruneConfig(PassConfig):
        ratio: float = param(0.5, min=0.0, max=0.99, help="fraction of weights zeroed")

    class PrunePass(GraphPass):
        name = "prune"
        Config = PruneConfig
        def preconditions(self, model): require_weight_matmuls(model, self.name)
        def transform(self, model, ctx) -> PassChanges: ...

then `register_pass(PrunePass)` (see `registry.py`). A pass mutates the `ir.Model` in place; the pipeline keeps
the serialized model from before the pass for the numerical check (`check.py`).
"""

from __future__ import annotations

import dataclasses
import time
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError, EdgekitError

DECODER = "decoder_model_merged.onnx"
VISION_ENCODER = "vision_encoder.onnx"
EMBED_TOKENS = "embed_tokens.onnx"
ALL_GRAPHS = (DECODER, VISION_ENCODER, EMBED_TOKENS)


class PassPreconditionError(EdgekitError):
    """The model does not have what the pass needs (e.g. no MatMul with a constant weight to quantize)."""

    code = "pass_precondition"


class PassFailedError(EdgekitError):
    """A pass ran but its result is unusable (e.g. the numerical check exceeded its bound)."""

    code = "pass_failed"


# --------------------------------------------------------------------------------------------------------------
# typed configs
# --------------------------------------------------------------------------------------------------------------
def param(default: Any, *, choices: Sequence[Any] | None = None, min: float | None = None,  # noqa: A002
          max: float | None = None, help: str = "") -> Any:  # noqa: A002
    """A config field with its allowed values; `PassConfig.from_mapping` enforces them and names the field."""
    meta = {"choices": tuple(choices) if choices is not None else None, "min": min, "max": max, "help": help}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _coerce(value: Any, kind: Any, where: str) -> Any:
    """Turn a TOML value or a `key=value` string into `kind` (bool, int, float, str, tuple/list of those)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
            return None
        return _coerce(value, args[0], where)
    if origin in (list, tuple):
        (item,) = typing.get_args(kind)[:1] or (str,)
        items = value.split(";") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        out = [_coerce(v.strip() if isinstance(v, str) else v, item, where) for v in items if v != ""]
        return tuple(out) if origin is tuple else out
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(as_float)
    if kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


@dataclass
class PassConfig:
    """Base of every pass's config. Subclasses are dataclasses whose fields use `param(...)`."""

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, where: str = "pass") -> "PassConfig":
        """Build from TOML values or parsed strings; unknown keys, wrong types and out-of-range values raise
        `ConfigError` naming `where.field`."""
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown parameter(s) {', '.join(unknown)}; "
                              f"known: {', '.join(known) or '(none)'}")
        kwargs = {}
        for name, raw in values.items():
            f = known[name]
            here = f"{where}.{name}"
            value = _coerce(raw, hints[name], here)
            _check_range(value, f.metadata, here)
            kwargs[name] = value
        config = cls(**kwargs)
        config.validate(where)
        return config

    @classmethod
    def from_string(cls, text: str, *, where: str = "pass") -> "PassConfig":
        """`block=32,method=awq` -> config. List values are separated by `;` (`keep=lm_head;model.layers.0.*`)."""
        values: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ConfigError(f"{where}: expected key=value, got {part!r}")
            key, value = (s.strip() for s in part.split("=", 1))
            values[key] = value
        return cls.from_mapping(values, where=where)

    def validate(self, where: str) -> None:
        """Cross-field checks; override and raise `ConfigError(f"{where}.field: ...")`."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


def _check_range(value: Any, meta: Mapping[str, Any], where: str) -> None:
    if value is None:
        return
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        choices = meta.get("choices")
        if choices is not None and item not in choices:
            raise ConfigError(f"{where}: {item!r} is not one of {', '.join(map(str, choices))}")
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and item < lo:
            raise ConfigError(f"{where}: {item!r} is below the minimum {lo}")
        if hi is not None and item > hi:
            raise ConfigError(f"{where}: {item!r} is above the maximum {hi}")


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("recipe not found", path)
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"not valid TOML ({exc})", path) from exc


# --------------------------------------------------------------------------------------------------------------
# what a pass sees and what it says
# --------------------------------------------------------------------------------------------------------------
@dataclass
class PassContext:
    """Everything beyond the model a pass may use. `calibration` maps a graph file name to a list of feed dicts
    (input name -> array) in that graph's input signature; passes that need data and find none make their own
    from the graph's signature (see `calibration.py`). `model_dir` lets a pass read sibling graphs or files."""

    graph: str = DECODER
    model_dir: Path | None = None
    calibration: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    seed: int = 0

    def feeds(self, graph: str | None = None) -> list[dict[str, np.ndarray]] | None:
        return self.calibration.get(graph or self.graph)


@dataclass
class PassChanges:
    """What a transform did; `notes` holds pass-specific facts worth keeping (e.g. the mixed-precision choice)."""

    nodes_added: int = 0
    nodes_removed: int = 0
    initializers_touched: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def modified(self) -> bool:
        return bool(self.nodes_added or self.nodes_removed or self.initializers_touched)


@dataclass
class OutputError:
    """Error of one graph output after the pass, against the model before it, on the same feeds."""

    name: str
    max_abs: float
    mean_abs: float
    rel_l2: float  # ||after - before|| / ||before|| over all samples
    max_rel: float  # max_abs / max|before|

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PassReport:
    """One pass on one graph: stamped into bundle provenance by `edgekit build`."""

    pass_name: str
    graph: str
    config: dict[str, Any]
    nodes_added: int
    nodes_removed: int
    initializers_touched: list[str]
    size_before: int  # bytes of initializers
    size_after: int
    seconds: float
    notes: dict[str, Any] = field(default_factory=dict)
    check: list[OutputError] | None = None
    check_samples: int = 0

    @property
    def modified(self) -> bool:
        return bool(self.nodes_added or self.nodes_removed or self.initializers_touched)

    def worst(self, output: str | None = None) -> OutputError | None:
        if not self.check:
            return None
        errs = [e for e in self.check if output is None or e.name == output]
        return max(errs, key=lambda e: e.rel_l2) if errs else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["initializers_touched"] = len(self.initializers_touched)
        return d


def initializer_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


# --------------------------------------------------------------------------------------------------------------
# the pass base class
# --------------------------------------------------------------------------------------------------------------
class GraphPass(ir.passes.InPlacePass):
    """An in-place onnx_ir pass with a typed config, user-facing preconditions and a `PassReport`.

    Subclasses set `name`, `Config`, optionally `graphs` (the files of a model directory it applies to; the
    decoder by default) and `needs_calibration`, and implement `preconditions` and `transform`.
    """

    name: ClassVar[str] = "pass"
    Config: ClassVar[type[PassConfig]] = PassConfig
    graphs: ClassVar[tuple[str, ...]] = (DECODER,)
    needs_calibration: ClassVar[bool] = False
    # The pipeline fails a pass whose worst output rel_l2 exceeds this (None: report only).
    max_rel_error: ClassVar[float | None] = None

    def __init__(self, config: PassConfig | None = None, **overrides: Any):
        if config is None:
            config = self.Config.from_mapping(overrides, where=self.name) if overrides else self.Config()
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, self.Config):
            raise TypeError(f"{self.name} takes a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config
        self.context = PassContext()
        self._last_changes: PassChanges | None = None

    @classmethod
    def from_string(cls, text: str) -> "GraphPass":
        return cls(cls.Config.from_string(text, where=cls.name))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "GraphPass":
        return cls(cls.Config.from_mapping(values, where=cls.name))

    def applies_to(self, graph: str) -> bool:
        return graph in self.graphs

    # to implement ----------------------------------------------------------------------------------------------
    def preconditions(self, model: ir.Model) -> None:
        """Raise `PassPreconditionError` (naming the graph and what is missing) if the pass cannot run."""

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        raise NotImplementedError

    # running ---------------------------------------------------------------------------------------------------
    def apply(self, model: ir.Model, ctx: PassContext | None = None) -> PassReport:
        """Check preconditions, transform in place, and report (without the numerical check: the pipeline or
        `check.check_pass` adds it, since it needs the model from before)."""
        ctx = ctx or self.context
        self.preconditions(model)
        before = initializer_bytes(model)
        start = time.perf_counter()
        changes = self.transform(model, ctx)
        seconds = time.perf_counter() - start
        self._last_changes = changes
        return PassReport(
            pass_name=self.name, graph=ctx.graph, config=self.config.to_dict(),
            nodes_added=changes.nodes_added, nodes_removed=changes.nodes_removed,
            initializers_touched=list(changes.initializers_touched), size_before=before,
            size_after=initializer_bytes(model), seconds=seconds, notes=dict(changes.notes),
        )

    # onnx_ir's PassBase protocol, so these passes also run under `ir.passes.PassManager`
    def requires(self, model: ir.Model) -> None:
        self.preconditions(model)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        changes = self.transform(model, self.context)
        self._last_changes = changes
        return ir.passes.PassResult(model, changes.modified)


# --------------------------------------------------------------------------------------------------------------
# helpers most weight passes need
# --------------------------------------------------------------------------------------------------------------
@dataclass
class WeightMatMul:
    """A MatMul whose B input is a constant weight, either an initializer (K, N) or `Transpose(initializer)` of
    an (N, K) Hugging Face `nn.Linear` weight. `name` is the weight's module name (`model.layers.0.mlp.up_proj`)."""

    node: ir.Node
    weight: ir.Value  # the initializer
    transpose: ir.Node | None  # the Transpose between them, if any

    @property
    def name(self) -> str:
        n = self.weight.name or ""
        return n[: -len(".weight")] if n.endswith(".weight") else n

    @property
    def activation(self) -> ir.Value:
        return self.node.inputs[0]

    def kn(self) -> np.ndarray:
        """The weight as MatMul consumes it, (K, N) float32."""
        w = self.weight.const_value.numpy()
        return np.asarray(w.T if self.transpose is not None else w, dtype=np.float32)

    @property
    def k(self) -> int:
        s = self.weight.shape
        return int(s[1] if self.transpose is not None else s[0])

    @property
    def n(self) -> int:
        s = self.weight.shape
        return int(s[0] if self.transpose is not None else s[1])


def _is_float_initializer(v: ir.Value | None) -> bool:
    return (v is not None and v.const_value is not None and v.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16)
            and v.shape is not None and len(v.shape) == 2)


def find_weight_matmuls(model: ir.Model) -> list[WeightMatMul]:
    """Every MatMul in the main graph fed by a constant 2-D float weight, in graph order."""
    out = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        b = node.inputs[1]
        producer = b.producer() if b is not None else None
        if _is_float_initializer(b) and b.is_initializer():
            out.append(WeightMatMul(node, b, None))
        elif (producer is not None and producer.op_type == "Transpose" and producer.domain in ("", "ai.onnx")
              and _is_float_initializer(producer.inputs[0]) and producer.inputs[0].is_initializer()):
            perm = producer.attributes.get("perm")
            if perm is None or list(perm.as_ints()) == [1, 0]:
                out.append(WeightMatMul(node, producer.inputs[0], producer))
    return out


def require_weight_matmuls(model: ir.Model, pass_name: str, graph: str = "") -> list[WeightMatMul]:
    found = find_weight_matmuls(model)
    if not found:
        where = f" in {graph}" if graph else ""
        raise PassPreconditionError(f"{pass_name}: no MatMul with a constant weight to quantize{where}",
                                    graph or None)
    return found


def remove_if_unused(model: ir.Model, node: ir.Node | None) -> int:
    """Drop `node` (e.g. a folded Transpose) once nothing reads its outputs; returns nodes removed (0 or 1)."""
    if node is None or node.graph is None:
        return 0
    if any(o.uses() or o.is_graph_output() for o in node.outputs):
        return 0
    inputs = list(node.inputs)
    model.graph.remove(node, safe=True)
    for v in inputs:  # an initializer nobody reads any more goes too
        if v is not None and v.is_initializer() and not v.uses() and not v.is_graph_output():
            model.graph.initializers.pop(v.name, None)
    return 1


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    import fnmatch

    return any(fnmatch.fnmatchcase(name, p) for p in patterns)
