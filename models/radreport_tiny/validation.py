"""What a training run says about its model on the val split: the teacher-forced loss, and greedy reports scored
at finding level.

The reports come from the core's engine (`edgekit.generate.generate_batch` over `TorchBackend.of_model`), the
loop every target's reports go through, so there is no second decoder to drift from it; they are parsed as the
reporter parses them and scored by `edgekit.eval` (`summarise_findings`), under the names and as the rates
`edgekit eval` reports, so a training log reads like an evaluation of the exported bundle.
"""

from __future__ import annotations

import numpy as np
import torch

from edgekit.eval.finding_metrics import StudyScore, score_study, summarise_findings
from edgekit.export.parity import TorchBackend, single_threaded_torch
from edgekit.findings import parse_report
from edgekit.generate import GenerationOptions, generate_batch

from .data import IGNORE, EncodedSplit, StudyText, eval_items, make_batch
from .determinism import to_torch
from .modeling import RadReportTiny
from .objectives import lm_loss
from .tokenizer import EOS_ID, PAD_ID, decode_report

SAMPLES = 6  # reports of the first batch kept verbatim in the result, to read beside the figures


@torch.no_grad()
def eval_loss(model: RadReportTiny, enc: EncodedSplit, batch_size: int) -> float:
    """Teacher-forced loss over every val study (first reference), weighted per token."""
    model.eval()
    items = [(i, t.modality, 0) for i, t in enumerate(enc.data.texts)]
    total, count = 0.0, 0
    for s in range(0, len(items), batch_size):
        b = to_torch(make_batch(enc, items[s : s + batch_size]))
        n = int((b["labels"][:, 1:] != IGNORE).sum())
        total += float(lm_loss(model, b)) * n
        count += n
    return total / max(1, count)


def greedy_reports(
    model: RadReportTiny, pixel_values: np.ndarray, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy token ids for each prompt with its row of `pixel_values` (b, frames, 1, H, W), up to `<eos>` (which
    is not among them), all rows decoded together by the engine. On one torch thread, restored after: the engine
    prefills row by row, and two threads contending with a busy machine made 64 reports 6x slower (7 s vs 40 s)."""
    model.eval()
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD_ID, np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left-padded, as generate_batch takes prompts of different lengths
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    options = GenerationOptions(max_new_tokens=max_new_tokens, stop_token_ids=[EOS_ID])
    with single_threaded_torch():
        results = generate_batch(TorchBackend.of_model(model), pixel_values, ids, options, prompt_attention_mask=mask)
    return [r.token_ids for r in results]


def score_report(truth: StudyText, text: str) -> StudyScore:
    """One report against its study's ground truth, parsed once as the reporter parses it."""
    parsed = parse_report(text)
    return score_study(list(truth.findings), list(truth.negatives), list(parsed.findings), list(parsed.negatives))


def recall_by_type(truths: list[StudyText], texts: list[str]) -> dict[str, float]:
    """Share of each finding type's true findings that the reports state at the right location: which finding the
    model misses, a breakdown `edgekit eval` does not make (it splits by kind of study)."""
    truth_n: dict[str, int] = {}
    found: dict[str, int] = {}
    for truth, text in zip(truths, texts):
        for f in truth.findings:
            truth_n[f.type] = truth_n.get(f.type, 0) + 1
        remaining = [(f.type, f.location) for f in truth.findings]
        for f in parse_report(text).findings:
            if (f.type, f.location) in remaining:
                remaining.remove((f.type, f.location))
                found[f.type] = found.get(f.type, 0) + 1
    return {k: round(found.get(k, 0) / n, 4) for k, n in sorted(truth_n.items())}


def evaluate_generation(
    model: RadReportTiny, tok, enc: EncodedSplit, max_new_tokens: int, batch_size: int = 64, limit: int | None = None
) -> dict:
    """Greedy reports for the val studies (`eval_items`: the cine ones a second time as XC; `limit`: only studies
    below it), scored at finding level against the ground truth."""
    items = eval_items(enc)
    if limit is not None:
        items = [it for it in items if it[0] < limit]
    texts: list[str] = []
    for s in range(0, len(items), batch_size):
        chunk = items[s : s + batch_size]
        pixels = enc.data.pixels[[i for i, _, _ in chunk]].astype(np.float32)
        prompts = [enc.prompts[i][modality] for i, modality, _ in chunk]
        texts += [decode_report(tok, ids) for ids in greedy_reports(model, pixels, prompts, max_new_tokens)]
    truths = [enc.data.texts[i] for i, _, _ in items]
    samples = [
        {"modality": modality, "indication": t.indication, "generated": text, "reference": t.references[0]}
        for (_, modality, _), t, text in list(zip(items, truths, texts))[: min(SAMPLES, batch_size)]
    ]
    return {
        "reports": len(items),
        "studies": len({i for i, _, _ in items}),
        **summarise_findings([score_report(t, text) for t, text in zip(truths, texts)]),
        "recall_by_type": recall_by_type(truths, texts),
        "samples": samples,
    }
