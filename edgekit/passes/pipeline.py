"""Run a list of passes over a model directory (the three graphs) and write the result atomically.

Why atomic: a quantization that fails half way must not leave a folder that looks like a finished model. All
output goes to a hidden sibling temp folder that is renamed onto `out` only when every pass and check succeeded.
Each pass on each graph gets its own numerical check against the model just before it; the reports are what
`edgekit build` stamps into bundle provenance (`PipelineResult.provenance()`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.bundle.manifest import MANIFEST_NAME
from edgekit.errors import BundleError, ConfigError
from edgekit.export.save import check_external_data, save_model

from .base import ALL_GRAPHS, GraphPass, OutputError, PassContext, PassFailedError, PassReport, initializer_bytes
from .calibration import embedding_table, sample_feeds
from .check import IN_MEMORY_LIMIT_BYTES, check_models, snapshot

# Above this many bytes of weights the numerical check (two ORT sessions of the graph, one after the other) is
# skipped and the reason recorded in each report's notes; pass `check_max_bytes` to move the line.
CHECK_MAX_BYTES = 12_000_000_000


@dataclass
class PipelineResult:
    out: Path
    reports: list[PassReport]
    end_to_end: dict[str, list[OutputError]] = field(default_factory=dict)  # original vs final, per graph
    seconds: float = 0.0

    def provenance(self) -> dict[str, Any]:
        return {
            "passes": [r.to_dict() for r in self.reports],
            "end_to_end_error": {g: [e.to_dict() for e in errs] for g, errs in self.end_to_end.items()},
        }

    def step(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """The bundle manifest's record of this run: every pass report (its settings, notes and check) beside the
        build's own parameters, so a bundle says what each pass chose, not only that it ran."""
        return {
            "name": name,
            "params": params,
            "passes": [r.to_dict() for r in self.reports],
            "seconds": round(self.seconds, 3),
        }


def resolve_source(path: str | Path) -> Path:
    """A model directory with the standard graph names, or a bundle (dir or .ekb) whose graphs are used."""
    path = Path(path)
    if not path.exists():
        raise ConfigError("model directory or bundle not found", path)
    if path.is_dir() and any((path / g).is_file() for g in ALL_GRAPHS) and not (path / MANIFEST_NAME).is_file():
        return path
    if (path / MANIFEST_NAME).is_file() or path.suffix == ".ekb":
        from edgekit.bundle import load_bundle

        bundle = load_bundle(path)
        for role, name in names.GRAPH_FILES.items():
            if role in bundle.roles and bundle.component(role).name != name:
                raise BundleError(
                    f"bundle component {role} is not named {name}; run optimize on the model directory instead", path
                )
        return bundle.root
    raise ConfigError(f"no ONNX graphs ({', '.join(ALL_GRAPHS)}) in this folder", path)


def run_checked(p: GraphPass, model: ir.Model, ctx: PassContext, graph: str, before, feeds) -> PassReport:
    """Run one pass. With `before` (the model just before it: a snapshot, or the source file), its numerical check
    measures the pass alone on `feeds`, and an error past the pass's `max_rel_error` stops the run."""
    report = p(model, ctx).report
    if before is not None:
        report.check = check_models(before, model, feeds)
        report.check_samples = len(feeds)
        worst = report.worst()
        if p.max_rel_error is not None and worst is not None and worst.rel_l2 > p.max_rel_error:
            raise PassFailedError(
                f"{p.name} on {graph}: output {worst.name} relative error {worst.rel_l2:.3g} exceeds {p.max_rel_error}"
            )
    return report


def run_pipeline(
    source: str | Path,
    out: str | Path,
    passes: Sequence[GraphPass],
    *,
    calibration: dict[str, list[dict[str, np.ndarray]]] | None = None,
    check: bool = True,
    check_samples: int = 4,
    overwrite: bool = False,
    seed: int = 0,
    on_pass: Callable[[GraphPass, str, str], None] | None = None,
    check_max_bytes: int = CHECK_MAX_BYTES,
) -> PipelineResult:
    """Apply `passes` (in order) to each graph they apply to; write graphs and every other file of `source`
    to `out`. `on_pass(pass, graph, "start"|"done")` drives progress bars.

    Graphs with external data are loaded lazily (memory-mapped) and checked for a missing or truncated data
    file first. Past 1.5 GB of weights the check compares through files rather than serialized bytes (the source
    graph itself for the first pass); past `check_max_bytes` it is skipped, with the reason in the reports."""
    if not passes:
        raise ConfigError("no passes given: `passes` is empty (give pass specs or a recipe's passes)")
    src, out = resolve_source(source), Path(out)
    check_output(src, out, overwrite)
    graphs = [g for g in ALL_GRAPHS if (src / g).is_file()]
    if not any(p.applies_to(g) for p in passes for g in graphs):
        raise ConfigError(f"none of the passes applies to the graphs in {src.name} ({', '.join(graphs)})", src)
    run = _Run(src, calibration, check, check_samples, seed, on_pass, check_max_bytes)
    start = time.perf_counter()
    tmp = staging_dir(out)
    reports: list[PassReport] = []
    end_to_end: dict[str, list[OutputError]] = {}
    try:
        # tokenizer, configs and the like travel with the graphs; a bundle's manifest does not (its checksums
        # describe the old graphs: `edgekit build` writes a new one)
        copy_other_files(src, tmp, set(ALL_GRAPHS) | {g + ".data" for g in ALL_GRAPHS} | {MANIFEST_NAME})
        embeddings = embedding_table(src)
        for graph in graphs:
            mine = [p for p in passes if p.applies_to(graph)]
            if not mine:
                _copy_graph(src / graph, tmp / graph)
                continue
            errors = run.graph(graph, mine, tmp, embeddings, reports)
            if errors is not None:
                end_to_end[graph] = errors
        _write_head_importance(tmp, reports)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PipelineResult(out=out, reports=reports, end_to_end=end_to_end, seconds=time.perf_counter() - start)


@dataclass
class _Run:
    """One `run_pipeline` call's settings, and how it runs its passes on one graph."""

    src: Path
    calibration: dict[str, list[dict[str, np.ndarray]]] | None
    check: bool
    check_samples: int
    seed: int
    on_pass: Callable[[GraphPass, str, str], None] | None
    check_max_bytes: int

    def graph(
        self, graph: str, mine: list[GraphPass], tmp: Path, embeddings, reports: list[PassReport]
    ) -> list[OutputError] | None:
        """Run `mine` on `graph`, each checked against the model just before it; append their reports, save the
        result into `tmp`. Returns the original-vs-final errors when several passes ran with the check on."""
        src, calibration = self.src, self.calibration
        model = ir.load(src / graph)
        check_external_data(model, src / graph)
        feeds = (calibration or {}).get(graph) or sample_feeds(
            model, self.check_samples, seed=self.seed, embeddings=embeddings
        )
        size = initializer_bytes(model)
        big = size > IN_MEMORY_LIMIT_BYTES
        if not big:  # small graphs live in memory (so they serialize); big ones stay memory-mapped
            ir.external_data.load_to_model(model)
        checking, skip_reason = self._checking(size)
        scratch = tmp / ".check"
        original = (src / graph if big else snapshot(model, scratch)) if checking else None
        for i, p in enumerate(mine):
            ctx = PassContext(graph=graph, model_dir=src, calibration=dict(calibration or {}), seed=self.seed)
            if self.on_pass:
                self.on_pass(p, graph, "start")
            before = None
            if checking:  # the unchanged source file is the "before" of a big graph's first pass
                before = original if i == 0 else snapshot(model, scratch, f"before-{i}-{graph}")
            report = run_checked(p, model, ctx, graph, before, feeds)
            if skip_reason:
                report.notes["check_skipped"] = skip_reason
            reports.append(report)
            if self.on_pass:
                self.on_pass(p, graph, "done")
        # `original` is set exactly when checking
        errors = check_models(original, model, feeds) if original is not None and len(mine) > 1 else None
        shutil.rmtree(scratch, ignore_errors=True)
        save_model(model, tmp / graph)
        return errors

    def _checking(self, size: int) -> tuple[bool, str | None]:
        """Whether the numerical check runs on a graph of `size` bytes of weights, and the note when it is skipped."""
        checking = self.check and size <= self.check_max_bytes
        skip_reason = (
            None
            if checking or not self.check
            else f"numerical check skipped: {size / 1e9:.1f} GB of weights exceeds check_max_bytes "
            f"({self.check_max_bytes / 1e9:.1f} GB)"
        )
        return checking, skip_reason


def _write_head_importance(tmp: Path, reports: list[PassReport]) -> None:
    """Measured scores or learned gates travel with the graphs: what the X1's DSS ranks heads by (the last)."""
    scores = [r.notes[names.HEAD_IMPORTANCE] for r in reports if names.HEAD_IMPORTANCE in r.notes]
    if scores:
        (tmp / names.HEAD_IMPORTANCE_FILE).write_text(json.dumps(scores[-1], indent=1) + "\n")


def _copy_graph(src: Path, dst: Path) -> None:
    shutil.copy2(src, dst)
    data = src.with_name(src.name + ".data")
    if data.is_file():
        shutil.copy2(data, dst.with_name(dst.name + ".data"))


def check_output(src: Path, out: Path, overwrite: bool) -> None:
    """The output of a pass run: never the input, and an existing one only when asked to replace it."""
    if out.resolve() == src.resolve():
        raise ConfigError("output must differ from the input (the input is never modified)", out)
    if out.exists() and not overwrite:
        raise ConfigError("output already exists (overwrite=True replaces it)", out)


def staging_dir(out: Path) -> Path:
    """An empty hidden folder beside `out` to write into; `publish_dir` (or a rename per file) makes it `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def copy_other_files(src: Path, dst: Path, skip: set[str]) -> None:
    """Every file and folder of `src` but those named in `skip` and hidden ones, copied into `dst`."""
    for item in src.iterdir():
        if item.name in skip or item.name.startswith("."):
            continue
        if item.is_file():
            shutil.copy2(item, dst / item.name)
        elif item.is_dir():
            shutil.copytree(item, dst / item.name)
