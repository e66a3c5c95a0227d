"""The contract every graph pass follows, and the one way to run it: onnx-ir's `PassBase.__call__`.

Why a layer over `onnx_ir.passes`: onnx-ir gives the run discipline (`requires` -> `call` -> `ensures`, the in-place
promise, `PassResult(model, modified)`); edgekit adds (1) a typed config users write on a command line or in TOML
(`config.py`), (2) preconditions that fail with an `EdgekitError` a user can act on, and (3) a `PassReport` that
`edgekit build` stamps into bundle provenance.

A pass holds only its configuration. What one run needs (which graph, the model folder beside it, calibration
data, the seed) is a `PassContext`; `pass_.bind(ctx)` joins the two into an onnx-ir in-place pass, and calling that
runs it, on its own, in an `ir.passes.PassManager` or in `run_pipeline` alike. `pass_(model, ctx)` is short for
`pass_.bind(ctx)(model)`. Writing a pass::

    @dataclass
    class PruneConfig(PassConfig):
        ratio: float = param(0.5, min=0.0, max=0.99, help="fraction of weights zeroed")

    class PrunePass(GraphPass):
        name = "prune"
        Config = PruneConfig
        config: PruneConfig  # the type checker's view of what __init__ checks
        def preconditions(self, model, ctx): require_weight_matmuls(model, self.name, ctx.graph)
        def transform(self, model, ctx) -> PassChanges: ...

then `register_pass(PrunePass)` (see `registry.py`). A pass mutates the `ir.Model` in place; the pipeline keeps
the serialized model from before the pass for the numerical check (`check.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from edgekit.errors import EdgekitError
from edgekit.names import DECODER, EMBED_TOKENS, VISION_ENCODER

from .config import PassConfig

# A model directory's graphs, decoder first: the order a pipeline visits them and lists their reports in.
ALL_GRAPHS = (DECODER, VISION_ENCODER, EMBED_TOKENS)


class PassPreconditionError(EdgekitError, ir.passes.PreconditionError):
    """The model does not have what the pass needs (e.g. no MatMul with a constant weight to quantize)."""

    code = "pass_precondition"


class PassFailedError(EdgekitError):
    """A pass ran but its result is unusable (e.g. the numerical check exceeded its bound)."""

    code = "pass_failed"


# --------------------------------------------------------------------------------------------------------------
# what a run sees and what it says
# --------------------------------------------------------------------------------------------------------------
@dataclass
class PassContext:
    """Everything beyond the model one run may use. `calibration` maps a graph file name to a list of feed dicts
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


@dataclass
class GraphPassResult(ir.passes.PassResult):
    """onnx-ir's result (the model, whether it changed) plus this run's report."""

    report: PassReport


def initializer_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


# --------------------------------------------------------------------------------------------------------------
# the pass and its runs
# --------------------------------------------------------------------------------------------------------------
class GraphPass:
    """A configured pass. Subclasses set `name`, `Config` (and annotate `config: ThatConfig`, which `__init__`
    checks it is), optionally `graphs` (the files of a model directory it applies to; the decoder by default) and
    `max_rel_error`, and implement `preconditions` and `transform` (and `postconditions` when there is something to
    promise about the result)."""

    name: ClassVar[str] = "pass"
    Config: ClassVar[type[PassConfig]] = PassConfig
    graphs: ClassVar[tuple[str, ...]] = (DECODER,)
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

    @classmethod
    def from_string(cls, text: str) -> GraphPass:
        return cls(cls.Config.from_string(text, where=cls.name))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> GraphPass:
        return cls(cls.Config.from_mapping(values, where=cls.name))

    def applies_to(self, graph: str) -> bool:
        return graph in self.graphs

    def min_opset(self) -> int | None:
        """The default-domain opset the pass's result needs (None: any). An ONNX file below it is upgraded first
        (`edgekit.passes.onnx_file`); edgekit's own graphs are opset 21 already."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    # to implement ----------------------------------------------------------------------------------------------
    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        """Raise `PassPreconditionError` (naming the graph and what is missing) if the pass cannot run."""

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        raise NotImplementedError

    def postconditions(self, model: ir.Model, ctx: PassContext) -> None:
        """Raise if the transformed model breaks a promise of the pass."""

    # running ---------------------------------------------------------------------------------------------------
    def bind(self, ctx: PassContext | None = None) -> BoundPass:
        """This pass with one run's context, as an onnx-ir pass (default: a lone graph of the first kind it
        applies to, no folder, no calibration data)."""
        return BoundPass(self, ctx if ctx is not None else PassContext(graph=self.graphs[0]))

    def __call__(self, model: ir.Model, ctx: PassContext | None = None) -> GraphPassResult:
        return self.bind(ctx)(model)


class BoundPass(ir.passes.InPlacePass):
    """One run of a `GraphPass`: preconditions, transform and report, postconditions, through onnx-ir's
    `PassBase.__call__`. The report is measured here, so every way of running a pass reports the same."""

    def __init__(self, graph_pass: GraphPass, ctx: PassContext):
        self.graph_pass = graph_pass
        self.context = ctx

    def __repr__(self) -> str:
        return f"{self.graph_pass!r} on {self.context.graph}"

    def __call__(self, model_or_result: ir.Model | ir.passes.PassResult, /) -> GraphPassResult:
        try:
            result = super().__call__(model_or_result)
        except ir.passes.InvariantError as err:
            # onnx-ir wraps what requires/ensures raise; a user-facing error keeps its own type and message
            if isinstance(err.__cause__, EdgekitError):
                raise err.__cause__ from None
            raise
        if not isinstance(result, GraphPassResult):  # onnx-ir returns what `call` made, typed as its base class
            raise TypeError(f"{self!r} returned a {type(result).__name__}, not a GraphPassResult")
        return result

    def requires(self, model: ir.Model) -> None:
        self.graph_pass.preconditions(model, self.context)

    def call(self, model: ir.Model) -> GraphPassResult:
        p, ctx = self.graph_pass, self.context
        before = initializer_bytes(model)
        start = time.perf_counter()
        changes = p.transform(model, ctx)
        seconds = time.perf_counter() - start
        report = PassReport(
            pass_name=p.name,
            graph=ctx.graph,
            config=p.config.to_dict(),
            nodes_added=changes.nodes_added,
            nodes_removed=changes.nodes_removed,
            initializers_touched=list(changes.initializers_touched),
            size_before=before,
            size_after=initializer_bytes(model),
            seconds=seconds,
            notes=dict(changes.notes),
        )
        return GraphPassResult(model, changes.modified, report)

    def ensures(self, model: ir.Model) -> None:
        self.graph_pass.postconditions(model, self.context)
