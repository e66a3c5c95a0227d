"""`edgekit pareto` on two tiny random-weight bundles: points measured in child processes, the front, the plot,
resuming without re-measuring, and a bad bundle refused before any work."""

from __future__ import annotations

import json

import pytest

from edgekit.bundle import load_bundle
from edgekit.cli.app import main
from edgekit.daemon.testing import write_tiny_model
from edgekit.pareto import read_profile
from edgekit.pareto.configs import expand
from edgekit.pareto.run import run_pareto


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    from edgekit.build import build

    root = tmp_path_factory.mktemp("pareto-bundles")
    out = []
    for seed in (1, 2):
        model = write_tiny_model(root / f"model-{seed}", seed=seed, max_new_tokens=8)
        out.append(build("cpu", root / f"tiny-{seed}", model_dir=model, parity=False))
    return [root / "tiny-1", root / "tiny-2"]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    from edgekit.models.synth import write_split

    return write_split(tmp_path_factory.mktemp("pareto-split") / "test", "test", 3).parent


def test_pareto_writes_points_front_and_plot(bundles, split, tmp_path, capsys):
    out = tmp_path / "profile"
    args = ["pareto", *map(str, bundles), "-o", str(out), "--data", str(split), "--limit", "2"]
    assert main([*args, "--max-new-tokens", "4", "--max-new-tokens", "8", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    profile = read_profile(out / "pareto.json")
    assert len(profile.points) == 4 and shown["front"] == [p.id for p in profile.front]
    for p in profile.points:
        assert p.count == 2 and p.latency_p95_ms >= p.latency_p50_ms > 0
        assert p.energy_source.startswith(("measured:", "estimated:")) and p.energy_j > 0
        assert p.bundle_digest == load_bundle(p.bundle).digest and p.peak_rss_mib > 50
        assert p.settings["max_new_tokens"] in (4, 8)
    assert (out / "pareto.png").stat().st_size > 10_000 and (out / "pareto.svg").read_text().startswith("<?xml")


def test_a_second_run_resumes_and_measures_only_new_points(bundles, split, tmp_path):
    configs = expand([load_bundle(b) for b in bundles], {"max_new_tokens": [4]})
    seen: list[tuple[str, bool]] = []
    kw = dict(split={"name": "test", "count": 2}, limit=2, on_point=lambda c, reused: seen.append((c.id, reused)))
    run_pareto(configs[:1], tmp_path, split, **kw)
    first = read_profile(tmp_path / "pareto.json").points[0]
    run_pareto(configs, tmp_path, split, **kw)
    assert seen == [(configs[0].id, False), (configs[0].id, True), (configs[1].id, False)]
    assert read_profile(tmp_path / "pareto.json").by_id()[first.id] == first  # kept as measured


def test_a_bad_bundle_is_one_line_before_any_point(split, tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["pareto", str(missing), "-o", str(tmp_path / "p"), "--data", str(split)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0]
    assert not (tmp_path / "p").exists()


def test_labels_of_close_front_points_stack_instead_of_overlapping():
    from edgekit.pareto.plot import label_offsets

    # three points a few points apart (as heads38, heads38 + frame skipping and a 32-token cap lie), one far away
    anchors = [(100.0, 300.0), (104.0, 305.0), (108.0, 305.0), (400.0, 100.0)]
    offsets = label_offsets(anchors)
    labels = [y + dy for (_, y), dy in zip(anchors, offsets)]
    assert offsets[0] == 4.0 and offsets[3] == 4.0  # alone: just above its point
    assert all(abs(a - b) >= 9.0 for i, a in enumerate(labels[:3]) for b in labels[i + 1 : 3])


def test_knob_flag_sets_any_targets_knob_and_refuses_one_they_lack(bundles, split, tmp_path, capsys):
    """`--knob NAME=VALUE`: the generic way a target's knob reaches the CLI (cpu's threads here, typed int); on a
    cpu bundle the X1's sparsity_target is one line naming the knobs it has, before any point."""
    out = tmp_path / "profile"
    args = ["pareto", str(bundles[0]), "-o", str(out), "--data", str(split), "--limit", "1", "--no-plot"]
    assert main([*args, "--knob", "threads=1", "--knob", "max_new_tokens=4", "--json"]) == 0
    capsys.readouterr()
    (point,) = read_profile(out / "pareto.json").points
    assert point.settings["threads"] == 1 and point.settings["max_new_tokens"] == 4
    assert main([*args, "--knob", "sparsity_target=0.5", "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--knob sparsity_target: not a knob of these bundles' targets" in err[0]
    assert "threads" in err[0]


def test_max_batch_reports_the_split_that_many_at_a_time_with_the_same_reports(bundles, split, tmp_path, capsys):
    """`--max-batch`: the split reported three at a time and decoded together. Greedy reports are the ones written
    one at a time (the same F1 and hallucination rate), and the point's power is its reports in flight over the
    median latency. (Each report's share of a host meter's window: tests/test_energy_sampler.py; rows sharing
    steps: tests/test_engine.py.)"""
    from edgekit.eval.runner import evaluate
    from edgekit.reporter import Reporter

    out = tmp_path / "profile"
    args = ["pareto", str(bundles[0]), "-o", str(out), "--data", str(split), "--limit", "3", "--no-plot"]
    assert main([*args, "--max-batch", "1", "--max-batch", "3", "--json"]) == 0
    capsys.readouterr()
    one, three = sorted(read_profile(out / "pareto.json").points, key=lambda p: p.in_flight)
    assert (one.in_flight, three.in_flight) == (1, 3) and three.id.endswith("[max_batch=3]")
    assert (three.f1, three.hallucination_rate, three.count) == (one.f1, one.hallucination_rate, one.count)
    assert three.power_w == pytest.approx(3 * three.energy_j / (three.latency_p50_ms / 1e3))
    assert three.drain_p95_ms == pytest.approx(three.latency_p95_ms / 3)

    reporter = Reporter(load_bundle(bundles[0]), threads=1, max_batch=3)
    try:
        alone = evaluate(reporter, split, limit=3, include_video=False)
        together = evaluate(reporter, split, limit=3, include_video=False, concurrency=3)
    finally:
        reporter.close()
    assert together["concurrency"] == 3
    assert [r["id"] for r in together["records"]] == [r["id"] for r in alone["records"]]
    assert [r["text"] for r in together["records"]] == [r["text"] for r in alone["records"]]
    # whether two reports overlap depends on the host's timing; one at a time, none shares a step
    assert {r["timings"]["decode_batch_mean"] for r in alone["records"]} == {1.0}
