"""Reports are unchanged by batching: the eval split written one at a time and eight at a time, on cpu or orin.

The default model's bundle for `--target` (radreport-tiny, built here as `edgekit build --target T` builds it;
cpu: the fused decoder served by `CpuSlotBackend`; orin: its graphs in ONNX Runtime, the reference TensorRT is
held to, `engine = "onnxruntime"`, rows by `targets/orin/rows.py`; x1 has its own, `bench/x1_batching.py`)
writes the reports of the first `--studies` studies of the eval split twice through one engine: with one row
(each report alone) and with up to `--batch` rows (all submitted at once; a row that finishes is replaced by the
next waiting report, so rows of different lengths decode together). Greedy, the bundle's own options and stop
token. It counts the reports whose tokens are identical, names the first that differs (and where), and gives
both runs' finding F1 against the references and their decode tokens/s. `--decoder portable` does the same with
the cpu target's portable decoder (`CpuBackend`, rows left-padded into one batch).

    python bench/batch_identity.py [--target cpu|orin] [--studies 48] [--batch 8] [--decoder fused|portable]
                                   [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from x1_batching import requests  # each study's request as the Reporter makes it (bench/ is on sys.path)

from edgekit.bundle import load_bundle
from edgekit.engine import Engine, Request
from edgekit.eval.finding_metrics import prf, score_study
from edgekit.eval.runner import default_test_split, load_split
from edgekit.findings import Finding, parse_report
from edgekit.plugins import load_backend
from edgekit.reporter import Reporter
from edgekit.target import RuntimeOptions

HERE = Path(__file__).resolve().parent
SETTINGS = {  # the run side's settings for an engine of `--batch` rows
    "cpu": lambda a: {"decoder": a.decoder, "max_rows": a.batch},
    "orin": lambda a: {"engine": "onnxruntime", "max_batch": a.batch},
}


def run(backend, positions, reqs: list[Request], batch: int) -> tuple[list[list[int]], float]:
    """All of `reqs` through one engine of `batch` rows: their tokens and the decode tokens/s of the run."""
    engine = Engine(backend, positions=positions, max_batch=batch)
    tickets = [engine.submit(r) for r in reqs]
    t0 = time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - t0
    results = [t.result() for t in tickets]
    engine.close()
    return [r.token_ids for r in results], sum(len(r.token_ids) for r in results) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--studies", type=int, default=48, help="the first N studies of the eval split")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target", choices=("cpu", "orin"), default="cpu")
    ap.add_argument("--decoder", choices=("fused", "portable"), default="fused", help="cpu: which decoder serves")
    ap.add_argument("--out", type=Path, help="default: bench/batch_identity[_orin].json")
    a = ap.parse_args()
    a.out = a.out or HERE / ("batch_identity.json" if a.target == "cpu" else f"batch_identity_{a.target}.json")
    data = default_test_split()
    studies = load_split(data)[: a.studies]
    with tempfile.TemporaryDirectory(prefix="edgekit-batch-identity-") as tmp:
        from edgekit.build import build

        b = load_bundle(build(a.target, Path(tmp) / a.target, parity=False).bundle)
        settings = SETTINGS[a.target](a)
        options = RuntimeOptions(threads=2, settings=settings)
        backend = load_backend(b, options)
        reporter = Reporter(b, backend=backend)
        reqs = requests(reporter, data, studies)
        one, rate_one = run(backend, reporter.positions, reqs, 1)
        many, rate_many = run(backend, reporter.positions, reqs, a.batch)
        decode = reporter.tokenizer.decode
        f1 = {}
        for name, tokens in (("batch1", one), (f"batch{a.batch}", many)):
            tp = fp = fn = 0
            for t, s in zip(tokens, studies):
                parsed = parse_report(decode([int(i) for i in t], skip_special_tokens=True).strip())
                truth = [Finding(**f) for f in s["findings"]]
                score = score_study(truth, s["negatives"], parsed.findings, parsed.negatives)
                tp, fp, fn = tp + score.tp, fp + score.fp, fn + score.fn
            f1[name] = prf(tp, fp, fn)[2]
        reporter.close()
    same = [x == y for x, y in zip(one, many)]
    first = next((i for i, s in enumerate(same) if not s), None)
    where = None
    if first is not None:
        x, y = one[first], many[first]
        where = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    doc = {
        "model": b.name,
        "target": a.target,
        "settings": settings,
        "decoder": type(backend).__name__,
        "split": str(data.name),
        "studies": len(studies),
        "batch": a.batch,
        "identical": sum(same),
        "first_difference": None if first is None else {"study": studies[first]["id"], "token": where},
        "finding_f1": f1,
        "decode_tok_s": {"batch1": rate_one, f"batch{a.batch}": rate_many},
        "source": "ONNX Runtime CPU, 2 threads, greedy; tokens of the same engine at 1 row and at "
        f"{a.batch} rows; F1 of edgekit.findings against the split's reference reports",
    }
    a.out.write_text(json.dumps(doc, indent=2))
    print(f"{b.name} {a.target} ({doc['decoder']}), eval split '{doc['split']}', {len(studies)} studies, greedy")
    print(f"{'run':>8} {'finding F1':>11} {'tok/s':>8}")
    for name in f1:
        print(f"{name:>8} {f1[name]:11.3f} {doc['decode_tok_s'][name]:8.0f}")
    differs = "" if first is None else f"; first difference {doc['first_difference']}"
    print(f"identical reports: {sum(same)}/{len(same)}{differs}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
