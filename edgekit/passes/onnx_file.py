"""Passes on ONNX files edgekit did not write: one `model.onnx`, or a folder of them.

Why beside `pipeline.py` and not inside it: a model directory has edgekit's graph roles (decoder, vision encoder,
embeddings) and each pass says which it applies to; a user's file has no role, so every pass given runs on it,
except those that only make sense on edgekit's own graphs, which are refused before anything is read (the
registry's `role_bound`). The rest is the same discipline: the file is read through `edgekit.onnx_model`
(unnamed nodes named, external data checked), the opset is raised only when a pass needs it
(`GraphPass.min_opset`, e.g. int4 for orin/x1 writes opset-21 blocked DequantizeLinear), calibration and
check feeds are generated from the graph's declared inputs (`calibration.sample_feeds`: symbolic dims by name,
`dims` overrides), each pass is checked in ONNX Runtime against the model just before it, and the result is
written atomically, with its weights as external data when the input kept them so.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.export.save import EXTERNAL_DATA_THRESHOLD_BYTES, save_model
from edgekit.onnx_model import default_opset, has_external_data, load_onnx, name_nodes, upgrade_opset

from .base import GraphPass, OutputError, PassContext, PassReport
from .calibration import sample_feeds
from .check import check_models, snapshot
from .pipeline import PipelineResult, check_output, copy_other_files, publish_dir, run_checked, staging_dir
from .registry import role_bound

# generated calibration feeds per file for a pass that does not size its own (int4's `calib` x `seq` does),
# seeded apart from the check's
CALIBRATION_SAMPLES, CALIBRATION_SEQ = 16, 32


def refuse_role_bound(passes: Sequence[GraphPass], source: str | Path) -> None:
    """One line for the first pass that needs edgekit's graph roles, before anything is read."""
    for p in passes:
        reason = role_bound(p.name)
        if reason:
            raise ConfigError(
                f"pass {p.name} needs edgekit's graph roles ({reason}); it runs on a model directory from "
                "`edgekit convert`, not on a single ONNX file",
                source,
            )


def optimize_onnx_file(
    source: str | Path,
    out: str | Path,
    passes: Sequence[GraphPass],
    *,
    calibration: Sequence[dict[str, np.ndarray]] | None = None,
    dims: Mapping[str, int] | None = None,
    check: bool = True,
    check_samples: int = 4,
    overwrite: bool = False,
    seed: int = 0,
    on_pass: Callable[[GraphPass, str, str], None] | None = None,
) -> PipelineResult:
    """Apply `passes` in order to the ONNX file `source` and write `out` (a file; `out.data` beside it when the
    input had external data)."""
    if not passes:
        raise ConfigError("no passes given: `passes` is empty (give pass specs or a recipe's passes)")
    src, out = Path(source), Path(out)
    refuse_role_bound(passes, src)
    check_output(src, out, overwrite)
    start = time.perf_counter()
    tmp = staging_dir(out)
    try:
        reports, end_to_end = _run(src, tmp / out.name, passes, calibration, dims, check, check_samples, seed, on_pass)
        stale = out.with_name(out.name + ".data")
        if stale.exists() and not (tmp / stale.name).exists():
            stale.unlink()  # an earlier output's weights must not sit beside a graph that no longer reads them
        for item in sorted(tmp.iterdir(), key=lambda p: p.suffix != ".data"):  # weights first, then the graph
            os.replace(item, out.parent / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = PipelineResult(out=out, reports=reports, seconds=time.perf_counter() - start)
    if end_to_end is not None:
        result.end_to_end[src.name] = end_to_end
    return result


def optimize_onnx_folder(
    source: str | Path,
    out: str | Path,
    passes: Sequence[GraphPass],
    *,
    dims: Mapping[str, int] | None = None,
    check: bool = True,
    check_samples: int = 4,
    overwrite: bool = False,
    seed: int = 0,
    on_pass: Callable[[GraphPass, str, str], None] | None = None,
) -> PipelineResult:
    """Every `*.onnx` file of the folder `source` through `optimize_onnx_file`, into the folder `out` (written
    atomically); the folder's other files are copied as they are."""
    src, out = Path(source), Path(out)
    graphs = sorted(p for p in src.glob("*.onnx") if p.is_file())
    if not graphs:
        raise ConfigError("no .onnx files in this folder", src)
    refuse_role_bound(passes, src)
    check_output(src, out, overwrite)
    start = time.perf_counter()
    tmp = staging_dir(out)
    reports: list[PassReport] = []
    end_to_end: dict[str, list[OutputError]] = {}
    try:
        copy_other_files(src, tmp, {g.name for g in graphs} | {g.name + ".data" for g in graphs})
        for graph in graphs:
            r, e = _run(graph, tmp / graph.name, passes, None, dims, check, check_samples, seed, on_pass)
            reports += r
            if e is not None:
                end_to_end[graph.name] = e
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PipelineResult(out=out, reports=reports, end_to_end=end_to_end, seconds=time.perf_counter() - start)


def _run(src: Path, dst: Path, passes, calibration, dims, check, check_samples, seed, on_pass):
    model = load_onnx(src)
    renamed = name_nodes(model)
    external = has_external_data(model)
    if not external:
        ir.external_data.load_to_model(model)
    graph = src.name
    check_feeds = sample_feeds(model, check_samples, seed=seed + 1, dims=dims)
    calibs = _calibrations(model, passes, calibration, seed, dims)  # before any pass changes the model
    scratch = dst.parent / f".check-{src.stem}"
    original = snapshot(model, scratch, "original.onnx") if check else None
    reports = []
    for i, p in enumerate(passes):
        needed = p.min_opset()
        opset_before = default_opset(model)
        if needed:
            model = upgrade_opset(model, needed, src)
        ctx = PassContext(graph=graph, model_dir=None, calibration={graph: calibs[i]}, seed=seed)
        if on_pass:
            on_pass(p, graph, "start")
        # the model just before this pass (after any opset upgrade): the check measures the pass alone
        before = snapshot(model, scratch, f"before-{i}.onnx") if check else None
        report = run_checked(p, model, ctx, graph, before, check_feeds)
        if renamed and i == 0:
            report.notes["nodes_named"] = renamed
        if default_opset(model) != opset_before:
            report.notes["opset_upgraded"] = f"{opset_before} -> {default_opset(model)}"
        reports.append(report)
        if on_pass:
            on_pass(p, graph, "done")
    # `original` is set exactly when checking
    end_to_end = check_models(original, model, check_feeds) if original is not None and len(passes) > 1 else None
    shutil.rmtree(scratch, ignore_errors=True)
    save_model(model, dst, external_data_threshold_bytes=0 if external else EXTERNAL_DATA_THRESHOLD_BYTES)
    return reports, end_to_end


def _calibrations(model: ir.Model, passes, calibration, seed: int, dims) -> list[list[dict[str, np.ndarray]]]:
    """Each pass's calibration feeds: the caller's, else generated in the file's signature, as many and as long as
    the pass's own `calib` and `seq` ask (before, a fixed 16 x 32 overrode int4's `calib=`/`seq=` on a file)."""
    if calibration:
        return [list(calibration)] * len(passes)
    made: dict[tuple[int, int], list[dict[str, np.ndarray]]] = {}
    out = []
    for p in passes:
        cfg = getattr(p, "config", None)
        size = (getattr(cfg, "calib", CALIBRATION_SAMPLES), getattr(cfg, "seq", CALIBRATION_SEQ))
        if size not in made:
            made[size] = sample_feeds(model, size[0], seq=size[1], seed=seed, dims=dims)
        out.append(made[size])
    return out
