"""`edgekit eval` of a text model's bundle: its reports for a JSON Lines file of prompts, scored against references.

    {"prompt": "FINDINGS: 6 mm nodule, right upper lobe. Write the impression.", "reference": "..."}
    {"id": "case-2", "prompt": "...", "reference": ["one phrasing", "another"]}

Every result names its split (the file's name) and sample count. BLEU-4 and ROUGE-L score every sample; finding
F1 only the samples whose reference states findings edgekit's parser reads (a reference it cannot parse has no
ground truth to score against, so it is left out of F1, and the figure says over how many it was computed). As for
studies, a prompt that fails (too long for the model's context) is recorded as a failure and the run goes on.
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
from edgekit.eval.runner import speed, text_scores
from edgekit.eval.text_metrics import rouge_l
from edgekit.findings import Finding, parse_report


def load_prompts(path: Path) -> list[dict]:
    """The file's samples, one per line: `prompt` (a non-empty string) and `reference` (a string or a list of
    them), `id` optional; a line that is not one is refused, naming its number."""
    path = Path(path)
    if not path.is_file():
        raise EdgekitError(
            'not a file: a text model is evaluated on a JSON Lines file of {"prompt": ..., "reference": ...}', path
        )
    samples = []
    for number, record in json_objects(path):
        prompt, reference = record.get("prompt"), record.get("reference")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EdgekitError(f"line {number}: needs a non-empty string 'prompt'", path)
        references = [reference] if isinstance(reference, str) else reference
        if not isinstance(references, list) or not references or not all(isinstance(r, str) for r in references):
            raise EdgekitError(f"line {number}: needs 'reference', a string or a list of strings", path)
        samples.append({"id": str(record.get("id", number)), "prompt": prompt, "references": references})
    if not samples:
        raise EdgekitError("no samples (one JSON object per line)", path)
    return samples


def _truth(references: list[str]) -> tuple[list[Finding], list[str]] | None:
    """The findings the first reference states, None when the parser reads none there (nothing to score F1 on)."""
    parsed = parse_report(references[0])
    if not parsed.findings and not parsed.negatives:
        return None
    return list(parsed.findings), list(parsed.negatives)


def finding_scores(scored: list[dict], *, resamples: int, seed: int) -> dict:
    """Finding F1 (with its interval), precision and recall over the records that carry a `score`."""
    if not scored:
        return {"finding_f1": None, "finding_precision": None, "finding_recall": None, "finding_n": 0}
    counts = np.array([[r["score"]["tp"], r["score"]["fp"], r["score"]["fn"]] for r in scored], dtype=np.float64)
    p, rec, f1 = prf(*counts.sum(0))
    ci = bootstrap_ci(counts, lambda c: prf(*c.sum(0))[2], resamples=resamples, seed=seed)
    return {
        "finding_f1": {"value": f1, "ci95": ci},
        "finding_precision": p,
        "finding_recall": rec,
        "finding_n": len(scored),
    }


def _record(reporter, sample: dict, options) -> dict:
    """One prompt's report, scored; or the error that kept it from being written."""
    rec = {"id": sample["id"], "error": None}
    try:
        rep = reporter.report_text(sample["prompt"], options)
    except EdgekitError as e:  # one prompt that does not fit is a finding of the run, not its end
        rec["error"] = {"code": e.code, "message": str(e)}
        return rec
    rec.update(
        text=rep.text,
        references=sample["references"],
        rouge_l=rouge_l(rep.text, sample["references"]),
        timings=rep.timings,
        cost=rep.cost,
        energy_j=rep.energy_j,
        energy_source=rep.energy_source,
        warnings=list(rep.warnings),
    )
    truth = _truth(sample["references"])
    if truth is not None:
        predicted = [Finding(**f) for f in rep.findings]
        rec["score"] = asdict(score_study(truth[0], truth[1], predicted, list(rep.negatives)))
    return rec


def evaluate_prompts(
    reporter,
    data: Path,
    *,
    limit: int | None = None,
    resamples: int = 1000,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    options=None,
    concurrency: int = 1,
) -> dict:
    """A report for every prompt of `data` (`reporter` holds a text model's bundle), scored. JSON-ready.
    `concurrency`: prompts in flight at once, which the reporter's engine decodes together; records in order."""
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    if concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    samples = load_prompts(data)[:limit]
    t0 = time.perf_counter()
    records = in_order(lambda sample: _record(reporter, sample, options), samples, concurrency, progress)
    ok = [r for r in records if r["error"] is None]
    overall: dict = {"n": len(ok), "failed": len(records) - len(ok)}
    if ok:
        overall.update(text_scores(ok, resamples=resamples, seed=seed))
        overall.update(finding_scores([r for r in ok if "score" in r], resamples=resamples, seed=seed))
        overall.update(speed(ok))
    return {
        "bundle": reporter.bundle.name,
        "target": reporter.bundle.target,
        "split": Path(data).stem,
        "data": str(data),
        "samples": len(samples),
        "prompts_with_warnings": sum(1 for r in records if r.get("warnings")),
        "overall": overall,
        "wall_s": time.perf_counter() - t0,
        "concurrency": concurrency,
        "rows_max": reporter.engine.rows_max,  # the most rows its engine may decode together (the target may cap it)
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "notes": {
            "bleu4": "sacrebleu corpus BLEU-4 against every reference phrasing",
            "rouge_l": "ROUGE-L F-measure on lower-cased words, best over the references",
            "finding_f1": "over the samples whose first reference states findings edgekit's parser reads "
            "(finding_n); a finding matches on (type, location)",
            "ci95": f"percentile bootstrap over samples, {resamples} resamples, seed {seed}",
        },
        "records": records,
    }
