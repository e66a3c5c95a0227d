"""`edgekit eval`: a bundle's reports on the synthetic test split (a text model's: on a JSON Lines file of prompts and
references), scored with 95% intervals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from edgekit.cli.options import (
    BundleArgument,
    Engine,
    EngineOption,
    ForceOption,
    JsonOption,
    ThreadsOption,
    engine_name,
    examples,
    out_option,
    runs_on,
)
from edgekit.cli.output import console, emit, progress, warn

app = typer.Typer(help="Evaluate a bundle's reports against references.")


def _fmt(metric: dict | float | None, scale: float = 1.0) -> str:
    if metric is None:
        return "-"
    if isinstance(metric, dict):
        lo, hi = metric["ci95"]
        return f"{metric['value'] * scale:.3g} [{lo * scale:.3g}, {hi * scale:.3g}]"
    return f"{metric * scale:.3g}"


def _count_cell(s: dict) -> str:
    """Overall count accuracy, then right/matched among the findings that can be more than one (CT nodules)."""
    c = s.get("count_accuracy_counted_types") or {}
    overall = "-" if s["count_accuracy"] is None else f"{s['count_accuracy']:.3f}"
    return overall + (f" ({c['correct']}/{c['n']} counted)" if c.get("n") else "")


def text_table_rows(result: dict) -> list[dict]:
    """A text model's evaluation: one row, finding F1 over the samples whose reference states findings."""
    s = result["overall"]
    if not s["n"]:
        return [{"split": result["split"], "n": 0, "failed": s["failed"]}]
    f1 = "-" if s["finding_f1"] is None else f"{_fmt(s['finding_f1'])} (n={s['finding_n']})"
    return [
        {
            "split": result["split"],
            "n": s["n"],
            "BLEU-4 [95% CI]": _fmt(s["bleu4"]),
            "ROUGE-L [95% CI]": _fmt(s["rouge_l"]),
            "finding F1 [95% CI]": f1,
            "p50 ms": f"{s['latency_ms']['p50']:.0f}",
            "decode tok/s": f"{s['decode_tokens_per_s']:.0f}",
            **cost_cells(s),
            "failed": s["failed"],
        }
    ]


def cost_cells(s: dict) -> dict:
    """What the target billed per report (x1: emulated; an orin bundle in ONNX Runtime: estimated), named by the
    kind of its source, and the DSS skip rate with the heads skipped per token where the target skipped heads."""
    cells = {}
    billed = s.get("billed")
    if billed:
        kind = billed["figure_source"].split(":")[0]
        cells[f"{kind} ms / mJ"] = f"{billed['latency_ms_per_report']:.3g} / {billed['energy_j_per_report'] * 1e3:.3g}"
    dss = s.get("dss")
    if dss:  # the rate, then the heads skipped per token of the heads a token has
        cells["DSS skip (heads/tok)"] = (
            f"{dss['skip_rate']:.3f} ({dss['heads_skipped_per_token']:.2f} of {dss['heads_per_token']:.0f})"
        )
    return cells


def cost_notes(result: dict) -> list[str]:
    """Where the billed and DSS columns come from, one line each (the overall figures')."""
    s = result["overall"]
    notes = []
    if s.get("billed"):
        b = s["billed"]
        kind = b["figure_source"].split(":")[0]
        source = b["source"] if b["source"].startswith(b["figure_source"]) else f"{b['figure_source']} ({b['source']})"
        notes.append(f"{kind} ms / mJ: per report, {source}; p50 ms: this machine's clock")
    if s.get("dss"):
        d = s["dss"]
        notes.append(
            f"DSS: {d['heads_skipped']} of {d['heads_total']} heads skipped over {d['tokens']} decode tokens "
            f"(target {d['sparsity_target']}, {d['source']})"
        )
    return notes


def table_rows(result: dict) -> list[dict]:
    groups = [("all (DICOM)", result["overall"]), *result["by_kind"].items()]
    if result.get("video"):
        groups.append(("video (MP4)", result["video"]))
    rows = []
    for name, s in groups:
        if not s.get("n"):
            rows.append({"subset": name, "n": 0, "failed": s.get("failed", 0)})
            continue
        rows.append(
            {
                "subset": name,
                "n": s["n"],
                "finding F1 [95% CI]": _fmt(s["finding_f1"]),
                "P": _fmt(s["finding_precision"]),
                "R": _fmt(s["finding_recall"]),
                "halluc.": _fmt(s["hallucinated_finding_rate"]),
                "count acc.": _count_cell(s),
                "size MAE mm": "-" if s["size_mae_mm"] is None else f"{s['size_mae_mm']:.1f}",
                "BLEU-4 [95% CI]": _fmt(s["bleu4"]),
                "ROUGE-L": _fmt(s["rouge_l"]["value"]),
                "p50 ms": f"{s['latency_ms']['p50']:.0f}",
                "decode tok/s": f"{s['decode_tokens_per_s']:.0f}",
                **cost_cells(s),
                "failed": s["failed"],
            }
        )
    return rows


@app.command(
    epilog=examples(
        "edgekit eval out/radreport-tiny-cpu --data data/test --limit 8",
        "edgekit eval out/radreport-tiny-x1 --data data/test --limit 4 --no-video -o out/eval-x1.json",
        "edgekit eval out/radreport-tiny-cpu --data data/test --limit 4 --json | jq .overall.finding_f1",
        "edgekit eval out/radreport-tiny-cpu --data data/test --limit 8 --no-video --concurrency 4",
        "edgekit eval out/radreport-tiny-x1 --data data/test --limit 2 --no-video --json | jq .overall.dss",
        "edgekit build --target orin -o out/radreport-tiny-orin --no-parity && edgekit eval out/radreport-tiny-orin "
        "--engine onnxruntime --data data/test --limit 2 --no-video",
        note="Without --data: the 240-study synthetic test split, generated once into the cache. A text model's "
        'bundle (a decoder alone) is evaluated on --data PROMPTS.jsonl, one {"prompt": ..., "reference": ...} per '
        "line (reference: a string or a list of phrasings): BLEU-4, ROUGE-L, and finding F1 where the references "
        "state findings. An x1 bundle adds its emulated ms and mJ per report and the DSS skip rate with the heads "
        "skipped per token (in --json: overall.billed, overall.dss); an orin bundle off the Jetson runs with "
        "--engine onnxruntime, its ms and mJ estimated by the Orin cost model.",
    )
)
def eval(  # noqa: A001 - the subcommand's name
    bundle: BundleArgument,
    data: Annotated[
        Path | None,
        typer.Option(
            help="A split written by `edgekit data synth` (default: the "
            "240-study test split, generated once into the cache); for a text model's bundle, a JSON Lines file "
            "of prompts and references."
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N studies.")] = None,
    concurrency: Annotated[
        int,
        typer.Option(
            min=1,
            help="Reports in flight at once, which the token engine decodes together (up to this many rows a step), "
            "their studies decoded in ingest processes as edgekitd does; records stay in the split's order.",
        ),
    ] = 1,
    video: Annotated[bool, typer.Option(help="Also score cine studies from their MP4 copies.")] = True,
    out: Annotated[Path | None, out_option("Write the full result (with per-study records) as JSON here.")] = None,
    force: ForceOption = False,
    threads: ThreadsOption = None,
    engine: EngineOption = Engine.default,
    as_json: JsonOption = False,
) -> None:
    """Finding-level P/R/F1, hallucination rate, BLEU-4 and ROUGE-L with bootstrap intervals, and latency."""
    from edgekit.bundle import load_bundle
    from edgekit.errors import ConfigError
    from edgekit.target import RuntimeOptions

    loaded = load_bundle(bundle)
    runtime = RuntimeOptions(threads=threads, engine=engine_name(engine))
    if loaded.is_text and data is None:
        raise ConfigError(
            'a text model\'s bundle is evaluated on --data PROMPTS.jsonl ({"prompt", "reference"} lines)', bundle
        )
    if not loaded.is_text and data is not None and data.is_file():
        raise ConfigError(
            "a file of prompts is for a text model's bundle; this one is a vision-language model's, evaluated on a "
            "split folder (edgekit data synth)",
            data,
        )
    reporter = in_flight_reporter(loaded, runtime, concurrency, bundle)
    if loaded.is_text:
        assert data is not None
        return _eval_text(reporter, data, limit, concurrency, out, runtime, as_json)
    from edgekit.eval.runner import default_test_split, evaluate

    data_dir = data if data is not None else default_test_split()
    with progress("reports", as_json=as_json) as task:
        result = evaluate(
            reporter,
            data_dir,
            limit=limit,
            include_video=video,
            progress=lambda done, total: task.update(completed=done, total=total),
            concurrency=concurrency,
        )
    result["engine"], where = runs_on(loaded, runtime.engine)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k != "records"}
    if summary["studies_with_warnings"]:
        warn(
            f"{summary['studies_with_warnings']} of {result['studies']} studies came with ingest warnings"
            + (f" (each in {out})" if out is not None else " (--out writes each)")
        )
    if as_json:
        emit(summary, True)
        return
    emit(
        table_rows(result),
        False,
        title=f"{result['bundle']} on {where}: synthetic test split, {result['studies']} studies",
    )
    for line in cost_notes(result):
        console.print(line, style="dim", markup=False)
    console.print(footer(result), style="dim", markup=False)


def footer(result: dict) -> str:
    """How the intervals were drawn, and the run's wall time with the reports it had in flight."""
    n, rows = result.get("concurrency", 1), result.get("rows_max", 1)
    flight = f", {n} in flight" + (f" ({rows} decoding at a time, the target's most)" if rows < n else "")
    return f"{result['notes']['ci95']}; eval wall time {result['wall_s']:.1f} s" + (flight if n > 1 else "")


def in_flight_reporter(bundle, runtime, concurrency: int, where: Path):
    """The bundle's reporter for `concurrency` reports in flight: its engine takes as many rows (the default when
    one at a time; the target may allow fewer: the result's `rows_max`). Refused where the target bills each report
    as if it ran alone (the Orin estimate), whose figures for reports decoded together would be wrong."""
    from edgekit.errors import ConfigError
    from edgekit.reporter import Reporter

    reporter = Reporter.from_bundle(bundle, runtime=runtime, **({"max_batch": concurrency} if concurrency > 1 else {}))
    if concurrency > 1 and getattr(reporter.backend, "bills_alone", False):
        reporter.close()
        raise ConfigError(
            f"--concurrency {concurrency}: this run's cost model bills each report as if it ran alone, so reports "
            "decoded together would be billed wrong; evaluate one at a time",
            where,
        )
    return reporter


def _eval_text(
    reporter, data: Path, limit: int | None, concurrency: int, out: Path | None, runtime, as_json: bool
) -> None:
    """A text model's bundle on a JSON Lines file of prompts and references."""
    from edgekit.eval.prompts import evaluate_prompts

    with progress("reports", as_json=as_json) as task:
        result = evaluate_prompts(
            reporter,
            data,
            limit=limit,
            progress=lambda done, total: task.update(completed=done, total=total),
            concurrency=concurrency,
        )
    result["engine"], where = runs_on(reporter.bundle, runtime.engine)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k != "records"}
    if as_json:
        emit(summary, True)
        return
    title = f"{result['bundle']} on {where}: {result['split']}, {result['samples']} prompts"
    emit(text_table_rows(result), False, title=title)
    for line in cost_notes(result):
        console.print(line, style="dim", markup=False)
    console.print(footer(result), style="dim", markup=False)
