"""`edgekit eval` on an x1 bundle states the DSS skip rate and the heads skipped per token beside the emulated cost,
pooled over the eval's own reports, and they agree with `edgekit profile` on the same study and prompt and with
the emulator's own counters (each report's `cost["dss"]`). A real x1 build of the daemon's tiny model; with the
bundle's settings it skips nothing (its heads all matter), so the library runs again with every head a candidate
(`sensitivity_threshold` 1.0, as tests/test_x1_batched.py does) to hold a non-zero rate to the same checks."""

from __future__ import annotations

import json

import pytest

from edgekit.cli.app import main
from edgekit.eval.runner import evaluate, load_split
from edgekit.profiling import profile_report
from edgekit.reporter import Reporter
from edgekit.target import RuntimeOptions

SKIPPING = {"sensitivity_threshold": 1.0}  # every head a candidate: DSS skips its whole budget


@pytest.fixture(scope="module")
def x1_bundle(tmp_path_factory):
    from edgekit.build import build
    from edgekit.daemon.testing import write_tiny_model

    root = tmp_path_factory.mktemp("x1-eval-dss")
    build("x1", root / "b", model_dir=write_tiny_model(root / "model", max_new_tokens=8), parity=False)
    return root / "b"


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    from edgekit.models.synth import write_split

    return write_split(tmp_path_factory.mktemp("x1-eval-dss-split") / "test", "test", 3).parent


def _pooled(records: list[dict]) -> tuple[float, float]:
    """Skip rate and heads skipped per token from the emulator's counters in each report's cost."""
    dss = [r["cost"]["dss"] for r in records]
    skipped = sum(d["heads_skipped"] for d in dss)
    return skipped / sum(d["heads_total"] for d in dss), skipped / sum(d["tokens"] for d in dss)


def test_eval_reports_the_skip_rate_and_heads_per_token_beside_the_emulated_cost(
    x1_bundle, split, tmp_path, capsys, monkeypatch
):
    from edgekit.cli import output

    monkeypatch.setattr(output.console, "width", 250)  # the table unfolded, whatever width the CLI started with
    full = tmp_path / "eval.json"
    assert main(["eval", str(x1_bundle), "--data", str(split), "--no-video", "-o", str(full), "--json"]) == 0
    overall = json.loads(capsys.readouterr().out)["overall"]
    dss, billed, emulated = overall["dss"], overall["billed"], overall["emulated"]
    assert 0.0 <= dss["skip_rate"] <= 1.0 and 0.0 <= dss["heads_skipped_per_token"] <= dss["heads_per_token"]
    assert dss["reports"] == overall["n"] == 3 and dss["sparsity_target"] == 0.38
    assert dss["heads_skipped_per_token"] == pytest.approx(dss["skip_rate"] * dss["heads_per_token"])
    records = json.loads(full.read_text())["records"]
    assert (dss["skip_rate"], dss["heads_skipped_per_token"]) == pytest.approx(_pooled(records))
    assert billed["figure_source"] == "emulated:x1" and billed["energy_j_per_report"] * 1e3 == pytest.approx(
        emulated["mj_per_report"]
    )
    by_kind = json.loads(full.read_text())["by_kind"]
    assert all(0.0 <= s["dss"]["skip_rate"] <= 1.0 for s in by_kind.values())

    assert main(["eval", str(x1_bundle), "--data", str(split), "--no-video"]) == 0
    table = capsys.readouterr().out
    assert "emulated ms / mJ" in table and "DSS skip (heads/tok)" in table
    row = f"{dss['skip_rate']:.3f} ({dss['heads_skipped_per_token']:.2f} of {dss['heads_per_token']:.0f})"
    (overall_row,) = [line for line in table.splitlines() if "all (DICOM)" in line]
    assert row in overall_row and f"{billed['latency_ms_per_report']:.3g} / " in overall_row
    assert f"DSS: {dss['heads_skipped']} of {dss['heads_total']} heads skipped over {dss['tokens']} decode" in table


def test_eval_and_profile_agree_on_one_study(x1_bundle, split, tmp_path, capsys):
    """The bundle's own settings through the CLI: eval of one study and profile of the same study and prompt."""
    study = load_split(split)[0]
    assert main(["eval", str(x1_bundle), "--data", str(split), "--limit", "1", "--no-video", "--json"]) == 0
    dss = json.loads(capsys.readouterr().out)["overall"]["dss"]
    args = ["profile", str(x1_bundle), "-s", str(split / study["path"]), "-o", str(tmp_path / "p"), "--json"]
    assert main([*args, "-p", study.get("indication", "")]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert dss["skip_rate"] == prof["dss"]["skip_rate"] == prof["cost"]["skip_rate"]
    assert dss["tokens"] == prof["dss"]["tokens"] and dss["heads_skipped"] == prof["dss"]["heads_skipped"]
    assert f"skip rate {dss['skip_rate']:.3f} of target" in prof["summary"]["DSS"]
    assert prof["summary"]["heads skipped / token"] == (
        f"{dss['heads_skipped_per_token']:.2f} of {dss['heads_per_token']:.0f}"
    )


def test_a_skipping_run_agrees_with_profile_and_the_counters(x1_bundle, split, tmp_path):
    """Every head a candidate: DSS skips up to its budget, and eval's pooled figures still equal profile's."""
    reporter = Reporter.from_bundle(x1_bundle, runtime=RuntimeOptions(threads=1, settings=SKIPPING))
    result = evaluate(reporter, split, include_video=False, resamples=10)
    dss = result["overall"]["dss"]
    assert 0.0 < dss["skip_rate"] <= 0.38 and dss["heads_skipped_per_token"] <= dss["budget_heads_per_token"]
    assert (dss["skip_rate"], dss["heads_skipped_per_token"]) == pytest.approx(_pooled(result["records"]))
    first, rows = load_split(split)[0], []
    prof = profile_report(
        x1_bundle, split / first["path"], first.get("indication", ""), tmp_path / "p", threads=1, settings=SKIPPING
    )
    rows = [r for r in result["records"] if r["id"] == first["id"] and r["source"] == "dicom"]
    assert rows[0]["cost"]["dss"] == prof["dss"] and prof["dss"]["heads_skipped"] > 0
    dense = evaluate(
        Reporter.from_bundle(x1_bundle, runtime=RuntimeOptions(threads=1, settings={"dss": False})),
        split,
        limit=1,
        include_video=False,
        resamples=10,
    )
    assert dense["overall"]["dss"] is None and dense["overall"]["emulated"] is not None  # DSS off: no record
