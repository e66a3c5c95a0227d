"""`edgekit eval`: a bundle's reports on an eval split (default: the model family's synthetic test split), scored
with intervals.

Every figure names its split and sample count; what the target emulated or metered per report (x1: time and
energy; an orin bundle run in ONNX Runtime: the Orin estimate's) is averaged beside the wall-clock latency, with
its source (`billed`), and where the target skipped attention heads (x1's dynamic head sparsity, a `dss` record
in each report's cost), the skip rate and heads skipped per token pooled over the reports (`dss`). A study that
cannot be read is recorded as a failure and the run goes on: one bad file never loses the rest of an evaluation.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from edgekit.errors import ConfigError, EdgekitError
from edgekit.eval.bootstrap import bootstrap_ci
from edgekit.eval.finding_metrics import prf, score_study
from edgekit.eval.in_flight import in_order
from edgekit.eval.jsonl import json_objects
from edgekit.eval.text_metrics import bleu_from_statistics, bleu_statistics, rouge_l
from edgekit.findings import Finding
from edgekit.ingest.study import IngestLimits

TEST_SPLIT_SIZE = 240


def _finding(d: dict) -> Finding:
    return Finding(**d)


_STUDY_KEYS = ("id", "modality", "path", "findings", "negatives", "references")  # what `evaluate` reads


def load_split(data_dir: Path) -> list[dict]:
    """The split's index, one study per line; a line that is not a study record is refused, naming its number."""
    index = data_dir / "studies.jsonl"
    if not index.is_file():
        raise EdgekitError("no studies.jsonl here; write a split with `edgekit data synth`", data_dir)
    studies = []
    for number, record in json_objects(index, hint="; write a split with `edgekit data synth`"):
        missing = [k for k in _STUDY_KEYS if k not in record]
        if missing:
            raise EdgekitError(f"line {number}: study record without {', '.join(missing)}", index)
        studies.append(record)
    return studies


def default_test_split(cache_root: Path | None = None, count: int = TEST_SPLIT_SIZE) -> Path:
    """The default model family's test split, generated once (deterministically) into the cache."""
    from edgekit.plugins import get_model_family

    return get_model_family().test_split(cache_root or Path.home() / ".cache" / "edgekit", count)


Row = tuple[dict, str, str]  # a study, the path of the file or folder to read, and its kind of source


def _rows(studies: list[dict], include_video: bool) -> list[Row]:
    rows = []
    for s in studies:
        rows.append((s, s["path"], "dicom"))
        if include_video and s.get("video_path"):
            rows.append((s, s["video_path"], "video"))
    return rows


def _counted_accuracy(ok: list[dict]) -> dict:
    """Count accuracy among matches of the types that can be more than one (CT nodules): the overall figure
    hides miscounts behind the many findings that are always one."""
    n = sum(r["score"]["counted_matches"] for r in ok)
    right = sum(r["score"]["counted_correct"] for r in ok)
    return {"value": right / n if n else None, "correct": right, "n": n}


def _summarise(records: list[dict], *, resamples: int, seed: int) -> dict:
    ok = [r for r in records if r.get("error") is None]
    if not ok:
        return {"n": 0, "failed": len(records)}
    counts = np.array([[r["score"]["tp"], r["score"]["fp"], r["score"]["fn"]] for r in ok], dtype=np.float64)
    p, rec, f1 = prf(*counts.sum(0))
    f1_ci = bootstrap_ci(counts, lambda c: prf(*c.sum(0))[2], resamples=resamples, seed=seed)
    predicted = sum(r["score"]["predicted"] for r in ok)
    tp = counts[:, 0].sum()
    sizes = [e for r in ok for e in r["score"]["size_abs_err_mm"]]
    return {
        "n": len(ok),
        "failed": len(records) - len(ok),
        "finding_f1": {"value": f1, "ci95": f1_ci},
        "finding_precision": p,
        "finding_recall": rec,
        "hallucinated_finding_rate": sum(r["score"]["hallucinated"] for r in ok) / predicted if predicted else 0.0,
        "reports_with_hallucination": float(np.mean([r["score"]["hallucinated"] > 0 for r in ok])),
        "contradiction_rate": float(np.mean([r["score"]["contradictions"] > 0 for r in ok])),
        "count_accuracy": sum(r["score"]["count_correct"] for r in ok) / tp if tp else None,
        "count_accuracy_counted_types": _counted_accuracy(ok),
        "size_mae_mm": float(np.mean(sizes)) if sizes else None,
        **text_scores(ok, resamples=resamples, seed=seed),
        **speed(ok),
    }


def text_scores(ok: list[dict], *, resamples: int, seed: int) -> dict:
    """BLEU-4 and ROUGE-L of scored records (each with `text`, `references`, `rouge_l`), with bootstrap intervals."""
    stats = bleu_statistics([r["text"] for r in ok], [r["references"] for r in ok])
    bleu_ci = bootstrap_ci(stats, bleu_from_statistics, resamples=resamples, seed=seed)
    rl = np.array([r["rouge_l"] for r in ok])
    rl_ci = bootstrap_ci(rl[:, None], lambda x: float(x.mean()), resamples=resamples, seed=seed)
    return {
        "bleu4": {"value": bleu_from_statistics(stats), "ci95": bleu_ci},
        "rouge_l": {"value": float(rl.mean()), "ci95": rl_ci},
    }


def billed(costs: list[dict]) -> dict | None:
    """The latency and energy the target billed per report (`energy_from_cost`'s keys: `latency_ms`, `energy_j`,
    `figure_source`), averaged, when every report states them under one label (`emulated:x1`,
    `estimated:orin-...`): the device's figures, not this machine's wall clock."""
    if not costs or not all("latency_ms" in c and "energy_j" in c for c in costs):
        return None
    labels = {c.get("figure_source") for c in costs}
    if len(labels) != 1 or None in labels:
        return None
    return {
        "latency_ms_per_report": float(np.mean([c["latency_ms"] for c in costs])),
        "energy_j_per_report": float(np.mean([c["energy_j"] for c in costs])),
        "figure_source": labels.pop(),
        "source": costs[0].get("source", "the target's backend") + f", mean of {len(costs)} reports",
    }


def head_skipping(costs: list[dict]) -> dict | None:
    """Dynamic head sparsity over the reports (x1: each cost's `dss` record, `targets/x1/dss.py`'s counts of the
    decode tokens a head mask was made for and the heads it skipped), pooled: the skip rate is every skipped head
    over every head of every such token, as `edgekit profile` states it for one report. None unless every report
    has a record (DSS off: none)."""
    records = [r for c in costs if isinstance(r := c.get("dss"), dict)]
    if not records or len(records) != len(costs):
        return None
    tokens = sum(r["tokens"] for r in records)
    total = sum(r["heads_total"] for r in records)
    skipped = sum(r["heads_skipped"] for r in records)
    first = records[0]
    return {
        "skip_rate": skipped / total if total else 0.0,
        "heads_skipped_per_token": skipped / tokens if tokens else 0.0,
        "heads_per_token": total / tokens if tokens else 0.0,
        "sparsity_target": first.get("sparsity_target"),
        "budget_heads_per_token": first.get("budget_heads_per_token"),
        "tokens": tokens,
        "heads_total": total,
        "heads_skipped": skipped,
        "reports": len(records),
        "source": "the target's head masks (DSS), pooled over the decode tokens of every report",
    }


def speed(ok: list[dict]) -> dict:
    """Wall-clock latency and decode speed of the records, and what the target emulated or billed and how many
    heads it skipped, when it did for all."""
    total_ms = np.array([r["timings"]["total_ms"] for r in ok])
    tps = np.array([r["timings"].get("decode_tokens_per_s", 0.0) for r in ok])
    costs = [r["cost"] for r in ok if r.get("cost")]
    every = len(costs) == len(ok)
    emulated = None
    if costs and every and all("mj_total" in c for c in costs):
        emulated = {
            "ms_per_report": float(np.mean([c["emulated_ms_total"] for c in costs])),
            "mj_per_report": float(np.mean([c["mj_total"] for c in costs])),
            "mj_per_token": float(np.mean([c["mj_per_token"] for c in costs])),
            "source": costs[0].get("source", "the target's backend") + f", mean of {len(costs)} reports",
        }
    return {
        "latency_ms": {"p50": float(np.percentile(total_ms, 50)), "p95": float(np.percentile(total_ms, 95))},
        "decode_tokens_per_s": float(tps.mean()),
        "emulated": emulated,
        "billed": billed(costs) if every else None,
        "dss": head_skipping(costs) if every else None,
    }


def _record(reporter, data_dir: Path, row: Row, options, workers=None) -> dict:
    """One study's report, scored; or the error that kept it from being written. With `workers` (reports in
    flight together) the study is decoded in an ingest process, as edgekitd decodes it, and `total_ms` is the
    wall time of both."""
    s, rel, source = row
    rec = {"id": s["id"], "kind": s.get("kind", s["modality"]), "source": source, "error": None}
    t0 = time.perf_counter()
    try:
        study = data_dir / rel if workers is None else workers.load(data_dir / rel, reporter.limits or IngestLimits())
        rep = reporter.report(study, prompt=s.get("indication", ""), options=options)
    except EdgekitError as e:  # one unreadable study is a finding of the run, not its end
        rec["error"] = {"code": e.code, "message": str(e)}
        return rec
    timings = rep.timings if workers is None else {**rep.timings, "total_ms": (time.perf_counter() - t0) * 1e3}
    truth = [_finding(f) for f in s["findings"]]  # the report is parsed once, by the reporter
    score = score_study(truth, s["negatives"], [_finding(f) for f in rep.findings], list(rep.negatives))
    rec.update(
        text=rep.text,
        references=s["references"],
        score=asdict(score),
        rouge_l=rouge_l(rep.text, s["references"]),
        timings=timings,
        cost=rep.cost,
        energy_j=rep.energy_j,
        energy_source=rep.energy_source,
        warnings=list(rep.warnings),
    )
    return rec


def _in_flight(reporter, data_dir: Path, rows: list[Row], options, concurrency: int, progress) -> list[dict]:
    """`rows` reported `concurrency` at a time, their studies decoded in ingest processes; in the split's order."""
    from edgekit.ingest.workers import IngestWorkers, default_processes

    workers = IngestWorkers(min(concurrency, default_processes()))
    try:
        return in_order(lambda row: _record(reporter, data_dir, row, options, workers), rows, concurrency, progress)
    finally:
        workers.close()


def evaluate(
    reporter,
    data_dir: Path,
    *,
    limit: int | None = None,
    include_video: bool = True,
    resamples: int = 1000,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    options=None,
    concurrency: int = 1,
) -> dict:
    """Generate a report for every study of the split and score it. Returns the JSON-ready result.
    `options`: the `GenerationOptions` of every report (default: the bundle's generation config). `concurrency`:
    reports in flight at once, from as many threads, which the reporter's engine decodes together, their studies
    decoded in ingest processes as edgekitd decodes them (in threads, pydicom's and the decoders' hold on the GIL
    would stall the engine's steps, and a host meter would bill one report the others' decoding); records stay in
    the split's order."""
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    if concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    studies = load_split(data_dir)
    if limit:
        studies = studies[:limit]
    rows = _rows(studies, include_video)

    t0 = time.perf_counter()
    if concurrency == 1:
        records = in_order(lambda row: _record(reporter, data_dir, row, options), rows, 1, progress)
    else:
        records = _in_flight(reporter, data_dir, rows, options, concurrency, progress)
    wall = time.perf_counter() - t0

    dicom = [r for r in records if r["source"] == "dicom"]
    by_kind = {}
    for kind in sorted({r["kind"] for r in dicom}):
        by_kind[kind] = _summarise([r for r in dicom if r["kind"] == kind], resamples=resamples, seed=seed)
    video = [r for r in records if r["source"] == "video"]
    return {
        "bundle": reporter.bundle.name,
        "target": reporter.bundle.target,
        "split": "test",
        "data": str(data_dir),
        "studies": len(studies),
        "studies_with_warnings": len({r["id"] for r in records if r.get("warnings")}),
        "overall": _summarise(dicom, resamples=resamples, seed=seed),
        "by_kind": by_kind,
        "video": _summarise(video, resamples=resamples, seed=seed) if video else None,
        "wall_s": wall,
        "concurrency": concurrency,
        "rows_max": reporter.engine.rows_max,  # the most rows its engine may decode together (the target may cap it)
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "notes": {
            "finding_match": "a finding matches on (type, location); count and size scored among matches",
            "hallucination": "a predicted finding whose type the study does not have",
            "contradiction": "a report stating absent a finding the study has",
            "bleu4": "sacrebleu corpus BLEU-4 against every reference phrasing",
            "ci95": f"percentile bootstrap over studies, {resamples} resamples, seed {seed}",
        },
        "records": records,
    }
