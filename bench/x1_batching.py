"""Continuous batching on the emulated X1: energy and time per token at batch 1 and batch 8, side by side.

The default model's x1 bundle (radreport-tiny, INT4, DSS as the bundle sets it) writes the reports of the first
`--studies` studies of the eval split twice through one engine (`edgekit.engine.Engine`) over `X1Backend`: once
with one row (each report alone, as before continuous batching), once with up to `--batch` rows (all submitted
at once; a row that finishes is replaced by the next waiting report). Per run, from the rows' own cost dicts and
the shared steps (`X1Backend.last_step`):

- decode mJ / token and emulated ms / token: each row's attributed part of its steps plus its token's embedding
  lookup, over all decoded tokens (`mj_per_token`, `emulated_ms_per_token` of the cost dicts, token-weighted);
- report mJ / token: everything a report cost (image encode, prompt, prefill, decode) over its decoded tokens;
- step ms: the emulated time of one decode step, i.e. the time between two tokens of a row;
- rows / step and the weight stream's share of the step energy (what batching shares);
- whether every report's tokens equal those it got at batch 1 (greedy).

    python bench/x1_batching.py [--studies 24] [--batch 8] [--bundle DIR] [--out bench/x1_batching.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from edgekit.bundle import load_bundle
from edgekit.engine import Engine, Request
from edgekit.eval.runner import default_test_split, load_split
from edgekit.ingest import load_study
from edgekit.reporter import Reporter
from edgekit.targets.x1.backend import X1Backend

HERE = Path(__file__).resolve().parent


def requests(reporter: Reporter, data: Path, studies: list[dict]) -> list[Request]:
    """Each study's request as the Reporter makes it: its prompt, its frames, the bundle's stop token."""
    out = []
    for s in studies:
        study = load_study(data / s["path"])
        layout = reporter.prompt(study.modality, s.get("indication", ""))
        pixels = reporter.pixel_values(study)[0]
        out.append(Request(layout.ids, reporter.default_options, pixels, image_slot=layout.image_slot))
    return out


def run(backend: X1Backend, positions, reqs: list[Request], batch: int) -> dict:
    """All of `reqs` through one engine of `batch` rows; the rows' costs and every shared step."""
    engine = Engine(backend, positions=positions, max_batch=batch)
    tickets = [engine.submit(r) for r in reqs]
    steps, last = [], None
    t0 = time.perf_counter()
    while engine.step():
        if backend.last_step is not last:  # the round ran a decode step
            last = backend.last_step
            steps.append(last)
    host_s = time.perf_counter() - t0
    results = [t.result() for t in tickets]
    costs = [r.cost for r in results]
    tokens = sum(c["decode_steps"] for c in costs)
    step_s = sum(s.seconds for s in steps)
    return {
        "batch": batch,
        "reports": len(reqs),
        "decoded_tokens": tokens,
        "decode_mj_per_token": sum(c["mj_per_token"] * c["decode_steps"] for c in costs) / tokens,
        "decode_emulated_ms_per_token": sum(c["emulated_ms_per_token"] * c["decode_steps"] for c in costs) / tokens,
        "report_mj_per_token": sum(c["mj_total"] for c in costs) / tokens,
        "report_mj_mean": sum(c["mj_total"] for c in costs) / len(costs),
        "step_ms_mean": step_s / len(steps) * 1e3,
        "steps": len(steps),
        "rows_per_step": sum(s.rows for s in steps) / len(steps),
        "weight_share_of_step_energy": sum(s.weight_energy_j for s in steps) / sum(s.energy_j for s in steps),
        "emulated_tokens_per_s": tokens / step_s,
        "skip_rate_mean": sum(c["skip_rate"] for c in costs) / len(costs),
        "host_s": host_s,
        "token_ids": [r.token_ids for r in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--studies", type=int, default=24, help="the first N studies of the eval split")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bundle", type=Path, help="an x1 bundle of the default model (default: built here)")
    ap.add_argument("--out", type=Path, default=HERE / "x1_batching.json")
    a = ap.parse_args()
    data = default_test_split()
    studies = load_split(data)[: a.studies]
    with tempfile.TemporaryDirectory(prefix="edgekit-x1-batching-") as tmp:
        bundle = a.bundle
        if bundle is None:
            from edgekit.build import build

            bundle = build("x1", Path(tmp) / "x1", parity=False).bundle
        b = load_bundle(bundle)
        backend = X1Backend(b, max_rows=a.batch)
        reporter = Reporter(b, backend=backend)  # the prompt layout and frames, as reports get them
        reqs = requests(reporter, data, studies)
        reporter.close()
        one = run(backend, reporter.positions, reqs, 1)
        many = run(backend, reporter.positions, reqs, a.batch)
    same = one.pop("token_ids") == many.pop("token_ids")
    doc = {
        "model": b.name,
        "machine": {"name": backend.machine.machine.name, "hash": backend.machine.hash},
        "dss": dict(backend.settings),
        "studies": [s["id"] for s in studies],
        "runs": [one, many],
        "batch_vs_1": {
            "decode_mj_per_token": many["decode_mj_per_token"] / one["decode_mj_per_token"],
            "report_mj_per_token": many["report_mj_per_token"] / one["report_mj_per_token"],
            "step_ms": many["step_ms_mean"] / one["step_ms_mean"],
            "emulated_tokens_per_s": many["emulated_tokens_per_s"] / one["emulated_tokens_per_s"],
        },
        "tokens_identical": same,
        "source": "edgekit x1 emulator (targets/x1/batch_step.py: one step for all rows, weights streamed once), "
        "per-row costs as X1Backend.release returns them",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2))
    cols = (
        ("batch", "batch", "{}"),
        ("rows/step", "rows_per_step", "{:.2f}"),
        ("decode mJ/tok", "decode_mj_per_token", "{:.4f}"),
        ("decode ms/tok", "decode_emulated_ms_per_token", "{:.4f}"),
        ("report mJ/tok", "report_mj_per_token", "{:.4f}"),
        ("step ms", "step_ms_mean", "{:.4f}"),
        ("tok/s", "emulated_tokens_per_s", "{:.0f}"),
        ("weights/step E", "weight_share_of_step_energy", "{:.2f}"),
        ("skip rate", "skip_rate_mean", "{:.3f}"),
    )
    print(f"{b.name} on x1 ({backend.machine.machine.name}), {len(reqs)} reports, {one['decoded_tokens']} tokens")
    print("  ".join(f"{h:>14}" for h, _, _ in cols))
    for r in (one, many):
        print("  ".join(f"{f.format(r[k]):>14}" for _, k, f in cols))
    v = doc["batch_vs_1"]
    print(
        f"batch {a.batch} vs 1: decode energy/token x{v['decode_mj_per_token']:.3f}, report energy/token "
        f"x{v['report_mj_per_token']:.3f}, step time x{v['step_ms']:.3f}, tokens/s x{v['emulated_tokens_per_s']:.2f}; "
        f"tokens identical: {same}"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
