"""`edgekit build --target x1` end to end on a tiny model: bundle with programs, `edgekit run`, `x1 inspect`."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from edgekit.bundle import load_bundle
from edgekit.cli.app import app
from edgekit.errors import ConfigError


@pytest.fixture(scope="module")
def x1_bundle(tmp_path_factory):
    from edgekit.daemon.testing import write_tiny_model

    root = tmp_path_factory.mktemp("x1b")
    model = write_tiny_model(root / "model", max_new_tokens=6)
    res = CliRunner().invoke(
        app, ["build", str(model), "--target", "x1", "-o", str(root / "b"), "--no-parity", "--json"]
    )
    assert res.exit_code == 0, res.output
    return root / "b"


def test_bundle_holds_programs_graphs_and_figures(x1_bundle):
    b = load_bundle(x1_bundle)
    assert b.target == "x1"
    assert {"x1_decoder", "x1_vision_encoder", "x1_embed_tokens", "x1_machine", "decoder"} <= set(b.roles)
    fig = b.manifest.figures["x1_compile"]
    assert len(fig["machine_hash"]) == 64 and fig["compile_seconds"] < 60
    assert fig["program_bytes"]["decoder"] == b.component("x1_decoder").stat().st_size
    assert all(v == 0 for v in fig["host_partitions"].values())


def test_run_generates_through_the_emulator(x1_bundle):
    from edgekit.models.synth import write_split
    from edgekit.reporter import Reporter
    from edgekit.targets.x1.backend import X1Backend

    data = x1_bundle.parent / "data"
    write_split(data, "sample", 1)
    study = json.loads((data / "studies.jsonl").read_text().splitlines()[0])["path"]
    res = CliRunner().invoke(app, ["run", str(x1_bundle), "-s", str(data / study), "--json"])
    assert res.exit_code == 0, res.output
    rep = Reporter.from_bundle(x1_bundle)
    assert isinstance(rep.backend, X1Backend)
    pv = np.zeros((1, 2, 1, 32, 32), np.float32)
    feats = rep.backend.encode_images(pv)
    cost = rep.backend.take_cost()
    assert (
        feats.shape[0] == 1
        and cost["phases"]["encode"] == {"calls": 1, "ms": cost["emulated_ms_total"], "mj": cost["mj_total"]}
        and cost["mj_total"] > 0
    )


def _sample_study(x1_bundle):
    from edgekit.models.synth import write_split

    data = x1_bundle.parent / "data1"
    if not (data / "studies.jsonl").is_file():
        write_split(data, "sample", 1)
    return data, json.loads((data / "studies.jsonl").read_text().splitlines()[0])


def test_the_bundle_carries_its_dss_settings_and_every_runner_honours_them(x1_bundle):
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions
    from edgekit.targets.x1.backend import RUNTIME_DEFAULTS

    b = load_bundle(x1_bundle)
    assert b.manifest.runtime == RUNTIME_DEFAULTS and RUNTIME_DEFAULTS["dss"] is True
    served = Reporter.from_bundle(x1_bundle)
    assert served.backend.dss_active and served.backend.policy is not None
    dense = Reporter(b, runtime=RuntimeOptions(settings={"dss": False}))
    assert not dense.backend.dss_active and dense.backend.policy is None
    with pytest.raises(ConfigError, match="unknown runtime setting.*sparsity_targte"):
        Reporter(b, runtime=RuntimeOptions(settings={"sparsity_targte": 0.2}))
    with pytest.raises(ConfigError, match="sparsity_target"):
        Reporter(b, runtime=RuntimeOptions(settings={"sparsity_target": 1.5}))


def test_reports_release_their_state_and_bill_only_themselves(x1_bundle):
    from edgekit.reporter import Reporter

    data, s = _sample_study(x1_bundle)
    rep = Reporter.from_bundle(x1_bundle)
    first = rep.report(data / s["path"])
    for _ in range(5):
        again = rep.report(data / s["path"])
        assert again.cost == first.cost and again.text == first.text
    be = rep.backend
    assert be.runs == [] and be.last_runs == []  # nothing kept without profiling
    assert be.take_cost()["mj_total"] == 0.0  # the last report took its own cost


def test_profile_and_eval_state_the_same_emulated_cost_for_a_study(x1_bundle, tmp_path):
    from edgekit.eval.runner import evaluate
    from edgekit.profiling import profile_report
    from edgekit.reporter import Reporter

    data, s = _sample_study(x1_bundle)
    ev = evaluate(Reporter.from_bundle(x1_bundle), data, limit=1, include_video=False, resamples=10)
    prof = profile_report(x1_bundle, data / s["path"], s.get("indication", ""), tmp_path / "p")
    assert ev["records"][0]["cost"]["mj_total"] == prof["cost"]["mj_total"] > 0
    assert ev["records"][0]["cost"]["emulated_ms_total"] == prof["cost"]["emulated_ms_total"]
    assert ev["overall"]["emulated"]["mj_per_report"] == prof["cost"]["mj_total"]


def test_head_mask_fn_gets_previous_step_stats(x1_bundle):
    from edgekit.targets.x1.backend import X1Backend

    seen = []

    def policy(stats):
        seen.append(stats.copy())
        mask = np.ones_like(stats, bool)
        mask[:, 0] = False
        return mask

    be = X1Backend(x1_bundle, head_mask_fn=policy)
    x = np.random.default_rng(0).standard_normal((1, 3, be.emulator.programs["decoder"].io["inputs"][0]["shape"][2]))
    logits, kv = be.decode(x.astype(np.float32), np.ones((1, 3), np.int64), np.arange(3)[None], None)
    for pos in (3, 4):
        logits, kv = be.decode(x[:, :1].astype(np.float32), np.ones((1, pos + 1), np.int64), np.array([[pos]]), kv)
    assert len(seen) == 1 and seen[0].shape == (be.num_layers, be.heads) and np.all(seen[0] > 0)
    assert be.last_mask is not None and not be.last_mask[:, 0].any()
    assert np.all(be.layer_stats[:, 0] == seen[0][:, 0])  # skipped heads keep their last norm
    with pytest.raises(ConfigError, match="head_mask_fn needs KV caching"):  # it would never be called
        X1Backend(x1_bundle, head_mask_fn=policy, settings={"kv_caching": False})


def test_inspect_disassembles_with_symbols(x1_bundle):
    res = CliRunner().invoke(app, ["x1", "inspect", str(x1_bundle / "decoder_model_merged.x1"), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["instructions"]
    gemm = [r for r in rows if r["mnemonic"] == "XL_GEMM.W4A8"]
    assert gemm and gemm[0]["symbol"].endswith("q_proj/MatMul") and rows[-1]["mnemonic"] == "END"


def test_inspect_refuses_a_truncated_program(x1_bundle, tmp_path, capsys):
    bad = tmp_path / "cut.x1"
    bad.write_bytes((x1_bundle / "decoder_model_merged.x1").read_bytes()[:1000])
    from edgekit.cli.app import main

    assert main(["x1", "inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and "cut.x1" in err


def test_the_default_int4_is_on_record_where_the_orin_estimate_reads_precision(x1_bundle):
    """The default build's own INT4 step carries its pass reports, so readers of a manifest's passes (the orin
    estimate's weight formats) see INT4 here rather than the FP32 of an untouched graph."""
    from edgekit.targets.orin.estimate import precision_from_manifest

    manifest = load_bundle(x1_bundle).manifest
    int4 = next(s for s in manifest.provenance["passes"] if s["name"] == "int4")
    precision, _ = precision_from_manifest(manifest)
    assert precision.weights == "int4" and precision.block == int4["params"]["block"] == 16  # the tiny model's K
