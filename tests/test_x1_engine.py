"""X1Engine / SparseConfig (the seed's SDK snippet), the engine's DSS accounting, and x1 traces/reports.

The engine runs on the real emulator backend (`edgekit.targets.x1.backend.X1Backend`); the trace tests use
hand-made instruction records so that their expected figures are known exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from edgekit.bundle import write_bundle
from edgekit.errors import BundleError, ConfigError, EdgekitError
from edgekit.export import export_model, random_weights
from edgekit.preprocess import PreprocessConfig
from edgekit.targets.x1 import trace as x1trace
from edgekit.targets.x1.engine import SparseConfig, X1Engine

from small_model import SMALL

REPO = Path(__file__).resolve().parents[1]


# --- hand-made instruction records, for the trace tests ----------------------------------------------
@dataclass
class Rec:
    index: int
    mnemonic: str
    queue: str
    symbol: str
    layer: int | None
    start_cycle: int
    cycles: int
    compute_cycles: int
    memory_cycles: int
    bound: str
    energy_pj: dict = field(default_factory=dict)


@dataclass
class Run:
    outputs: dict
    records: list
    captured: dict
    totals: dict


def _records(layers: int, active: np.ndarray | None) -> list[Rec]:
    out, t = [], 0
    for l in range(layers):
        heads = int(active[l].sum()) if active is not None else 4
        for q, mn, sym, cyc, bound in (
            ("LOAD", "VLD.GLB.128B", f"/model/layers.{l}/self_attn/q_proj/MatMul", 100, "memory"),
            ("COMPUTE", "XL_GEMM.W4A8", f"/model/layers.{l}/self_attn/q_proj/MatMul", 50 * heads, "memory"),
            ("COMPUTE", "XL_VMATMUL_CAUSAL", f"/model/layers.{l}/self_attn/MatMul", 30 * heads, "compute"),
            ("STORE", "VST.GLB.128B", f"/model/layers.{l}/Add_1", 40, "memory"),
        ):
            out.append(Rec(len(out), mn, q, sym, l, t, cyc, cyc // 2, cyc, bound, {"sram_read_bit": 10.0 * cyc}))
            t += cyc if q == "COMPUTE" else cyc // 2
    return out


def _run(records: list[Rec]) -> Run:
    cycles = max(r.start_cycle + r.cycles for r in records)
    return Run(
        {},
        records,
        {},
        {
            "cycles": cycles,
            "seconds": cycles / 1e9,
            "energy_j": sum(sum(r.energy_pj.values()) for r in records) * 1e-12,
        },
    )


@pytest.fixture
def x1_backend():
    """The real emulator backend: these tests exercise edgekit's own X1Backend, never a stand-in."""
    from edgekit.targets.x1.backend import X1Backend

    return X1Backend


def _tokenizer(path: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<pad>", "<bos>", "<eos>", "<sep>", "<unk>", "CR:", "CT:", "US:", "FINDINGS:", "normal"]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def x1_bundle(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("x1eng")
    src = tmp / "src"
    graphs = export_model(random_weights(SMALL, seed=3), SMALL, src)
    (src / "config.json").write_text(json.dumps(SMALL.to_dict()))
    (src / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "sep_token_id": 3,
                "pad_token_id": 0,
                "max_new_tokens": 12,
                "prompt_template": "{modality}: {prompt}",
            }
        )
    )
    PreprocessConfig(image_size=32, num_frames=2).save(src / "preprocessor_config.json")
    components = {
        "vision_encoder": graphs.vision_encoder,
        "embed_tokens": graphs.embed_tokens,
        "decoder": graphs.decoder,
        "tokenizer": _tokenizer(src / "tokenizer.json", SMALL.vocab_size),
        "generation_config": src / "generation_config.json",
        "preprocessor_config": src / "preprocessor_config.json",
        "model_config": src / "config.json",
    }
    from edgekit.targets.x1.backend import PROGRAM_FILES, PROGRAM_ROLES
    from edgekit.targets.x1.compiler import compile_model
    from edgekit.targets.x1.machine import load_machine

    for graph, program in compile_model(src, load_machine()).items():  # the backend runs compiled programs
        components[PROGRAM_ROLES[graph]] = program.save(src / PROGRAM_FILES[graph])
    return write_bundle(tmp / "tiny-x1", components, name="tiny", target="x1")


# --- SparseConfig ------------------------------------------------------------------------------------------------
def test_sparse_config_defaults_are_the_seed_operating_point():
    c = SparseConfig()
    assert (c.sparsity_target, c.sensitivity_threshold, c.enable_kv_caching) == (0.38, 0.015, True)


@pytest.mark.parametrize(
    "kw, field_name",
    [
        ({"sparsity_target": 1.0}, "sparsity_target"),
        ({"sparsity_target": -0.1}, "sparsity_target"),
        ({"sparsity_target": "0.38"}, "sparsity_target"),
        ({"sensitivity_threshold": 2.0}, "sensitivity_threshold"),
        ({"sensitivity_threshold": -1e-3}, "sensitivity_threshold"),
        ({"enable_kv_caching": "yes"}, "enable_kv_caching"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"sparsity_target": True}, "sparsity_target"),
    ],
)
def test_sparse_config_names_the_bad_field(kw, field_name):
    with pytest.raises(ConfigError, match=field_name):
        SparseConfig(**kw)


# --- the engine --------------------------------------------------------------------------------------------------
def test_the_seed_snippet_runs_as_written(x1_bundle, x1_backend):
    input_tokens = [1, 5, 20, 33, 3]
    config = SparseConfig(sparsity_target=0.38, sensitivity_threshold=0.015, enable_kv_caching=True)
    engine = X1Engine(model_path=str(x1_bundle), config=config)
    output = engine.generate(input_ids=input_tokens, max_new_tokens=128, temperature=0.7)
    assert isinstance(output, list) and all(isinstance(t, int) and 0 <= t < SMALL.vocab_size for t in output)
    s = engine.last_stats
    assert s["tokens"] == len(output) and s["sparsity_target"] == 0.38
    assert s["emulated_ms_total"] > 0 and s["mj_total"] > 0  # unseeded: the first sample may be the stop token
    assert s["decode_steps"] == 0 or (s["emulated_ms_per_token"] > 0 and s["mj_per_token"] > 0)
    assert 0.0 <= s["skip_rate"] <= 0.38


def test_seeded_sampling_reproduces_and_greedy_matches_onnx_runtime(x1_bundle, x1_backend):
    engine = X1Engine(x1_bundle, SparseConfig(enable_sparsity=False))
    a = engine.generate([1, 7, 8, 3], max_new_tokens=8, temperature=1.0, seed=5)
    b = engine.generate([1, 7, 8, 3], max_new_tokens=8, temperature=1.0, seed=5)
    assert a == b
    greedy = engine.generate(np.array([[1, 7, 8, 3]]), max_new_tokens=6, temperature=0, stop_token_ids=[])
    assert len(greedy) == 6
    no_cache = X1Engine(x1_bundle, SparseConfig(enable_sparsity=False, enable_kv_caching=False))
    assert no_cache.generate([1, 7, 8, 3], max_new_tokens=6, temperature=0, stop_token_ids=[]) == greedy


def test_dss_reaches_its_budget_when_every_head_is_a_candidate(x1_bundle, x1_backend):
    engine = X1Engine(x1_bundle, SparseConfig(sparsity_target=0.38, sensitivity_threshold=1.0))
    out = engine.generate([1, 9, 3], max_new_tokens=10, temperature=0, stop_token_ids=[])
    assert len(out) == 10
    dss = engine.last_stats["dss"]
    budget = math.floor(0.38 * SMALL.layers * SMALL.heads)
    assert dss["budget_heads_per_token"] == budget
    # 9 decode calls: the first dense, the other 8 at the full budget
    assert dss["tokens"] == 9 and dss["heads_skipped"] == 8 * budget
    assert engine.last_stats["skip_rate"] == pytest.approx(8 * budget / (9 * SMALL.layers * SMALL.heads))


def test_dss_off_costs_more_emulated_time_than_dss_on(x1_bundle, x1_backend):
    runs = {}
    for on in (False, True):
        e = X1Engine(x1_bundle, SparseConfig(enable_sparsity=on, sensitivity_threshold=1.0))
        e.generate([1, 9, 3], max_new_tokens=8, temperature=0, stop_token_ids=[])
        runs[on] = e.last_stats
    assert runs[True]["emulated_ms_per_token"] < runs[False]["emulated_ms_per_token"]
    assert runs[False]["skip_rate"] == 0.0


def test_bad_input_ids_and_bundles_are_clear_errors(x1_bundle, x1_backend, tmp_path):
    engine = X1Engine(x1_bundle, SparseConfig())
    with pytest.raises(EdgekitError, match=r"\[0, 97\)"):
        engine.generate([1, 500])
    with pytest.raises(EdgekitError, match="input_ids"):
        engine.generate([[1, 2], [3, 4]])
    with pytest.raises(EdgekitError, match="input_ids"):
        engine.generate([0.5, 1.5])
    with pytest.raises(BundleError, match="no bundle named"):
        X1Engine("no-such-model", SparseConfig())
    with pytest.raises(ConfigError, match="SparseConfig"):
        X1Engine(x1_bundle, config={"sparsity_target": 0.38})


def test_a_bundle_for_another_target_is_refused(x1_bundle, tmp_path):
    from edgekit.bundle import load_bundle

    b = load_bundle(x1_bundle)
    cpu = write_bundle(tmp_path / "cpu", {r: b.component(r) for r in b.roles}, name="tiny", target="cpu")
    with pytest.raises(BundleError, match="not x1"):
        X1Engine(cpu)


def test_a_name_resolves_through_the_bundle_path(x1_bundle, x1_backend, monkeypatch):
    monkeypatch.setenv("EDGEKIT_BUNDLE_PATH", str(Path(x1_bundle).parent))
    engine = X1Engine(model_path="tiny", config=SparseConfig())
    assert engine.bundle.target == "x1"


def test_report_on_a_study_returns_an_edgekit_report(x1_bundle, x1_backend):
    engine = X1Engine(x1_bundle, SparseConfig())
    report = engine.report(REPO / "models" / "samples" / "cr_chest", "Follow-up.")
    assert report.target == "x1" and report.study.startswith("uid:")
    assert engine.last_stats["tokens"] == report.timings["new_tokens"]
    assert "encode" in report.cost["phases"] and "prefill" in report.cost["phases"]
    assert report.cost["decode_steps"] >= report.timings["new_tokens"] - 1 and report.cost["mj_total"] > 0


# --- traces and reports ------------------------------------------------------------------------------------------
def test_trace_loads_and_has_the_three_queues(tmp_path):
    history = [
        ("prefill", _run(_records(2, None))),
        ("decode", _run(_records(2, None))),
        ("decode", _run(_records(2, np.array([[True, False, True, True]] * 2)))),
    ]
    doc = x1trace.chrome_trace(history, 1e9, machine="x1-default")
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"LOAD", "COMPUTE", "STORE"} <= names
    spans = [e for e in events if e["ph"] == "X" and e.get("cat") in x1trace.QUEUES]
    assert {e["cat"] for e in spans} == set(x1trace.QUEUES)
    assert all(e["dur"] >= 0 and "symbol" in e["args"] and "bound" in e["args"] for e in spans)
    calls = [e for e in events if e.get("cat") == "call"]
    assert [c["name"] for c in calls] == ["prefill", "decode 1", "decode 2"]
    assert calls[1]["ts"] == pytest.approx(calls[0]["ts"] + calls[0]["dur"])  # runs laid end to end


def test_reports_and_plot(tmp_path):
    history = [("prefill", _run(_records(2, None))), ("decode", _run(_records(2, None)))]
    result = x1trace.write_profile(history, 1e9, tmp_path, title="test")
    for name in ("trace", "ops", "layers", "tokens", "layer_types", "plot"):
        assert Path(result["paths"][name]).stat().st_size > 0
    layers = {r["layer"]: r for r in result["layers"]}
    assert set(layers) == {0, 1}
    total_ms = sum(r["ms"] for r in result["ops"])
    assert total_ms == pytest.approx(sum(r["ms"] for r in result["layers"]))
    types_ = {r["layer_type"]: r for r in result["layer_types"]}
    assert types_["self_attn.q_proj"]["bound"] == "memory" and types_["self_attn"]["bound"] == "compute"
    assert [t["call"] for t in result["tokens"]] == ["prefill", "decode 1"]
    assert (tmp_path / "ops.csv").read_text().splitlines()[0].startswith("count,")


def test_edgekit_profile_on_an_x1_bundle_writes_trace_reports_and_plot(x1_bundle, x1_backend, tmp_path, capsys):
    from edgekit.cli.app import main

    out = tmp_path / "prof"
    rc = main(
        ["profile", str(x1_bundle), "--study", str(REPO / "models" / "samples" / "cr_chest"), "-o", str(out), "--json"]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["target"] == "x1" and result["per_report"]["emulated_ms"] > 0 and result["per_report"]["mj"] > 0
    assert all(r["bound"] in ("compute", "memory", "dispatch") for r in result["layers"])
    trace = json.loads((out / "trace.json").read_text())
    assert {"LOAD", "COMPUTE", "STORE"} <= {
        e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"
    }
    for name in ("ops.csv", "layers.json", "tokens.csv", "layer_types.png", "profile.json"):
        assert (out / name).stat().st_size > 0


def test_emulator_accuracy_analysis_single_mode_runs_layers_on_reference_inputs(x1_bundle, x1_backend):
    import onnx

    from edgekit.bundle import load_bundle
    from edgekit.targets.x1.analysis import EmulatorRunner, analyze, decoder_prefill_feeds
    from edgekit.targets.x1.backend import X1Backend

    b = load_bundle(x1_bundle)
    model = onnx.load(str(b.component("decoder")))
    emu = X1Backend(b).emulator
    feeds = decoder_prefill_feeds(model, seq=6)
    runner = EmulatorRunner(emu, "decoder")
    entire = analyze(model, runner, feeds, mode="entire", flag_below_db=10.0)
    single = analyze(model, runner, feeds, mode="single", flag_below_db=10.0)
    by_e = {r.layer: r for r in entire.layers}
    by_s = {r.layer: r for r in single.layers}
    compared = [k for k in by_e if "layers." in k and by_e[k].values]
    assert compared, "the emulator captured no layer output"
    for k in compared:
        assert by_e[k].cosine > 0.9, k  # INT8/INT4 numerics, but the same function
    # fed reference inputs, the last layer's error is its own only: no worse than with errors accumulated
    last = compared[-1]
    assert by_s[last].snr_db >= by_e[last].snr_db - 1.0
