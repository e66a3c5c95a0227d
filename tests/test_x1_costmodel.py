"""The X1 analytic cost model: scaling laws it must obey, DSS savings, KV spill, the CLI, and the seed calibration."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from typer.testing import CliRunner

from edgekit.describe_model import describe
from edgekit.errors import ConfigError
from edgekit.model_description import QWEN2_7B, SMOLLM2_135M
from edgekit.targets.x1.costmodel import Workload, estimate_decode, kv_placement
from edgekit.targets.x1.machine import Machine, load_machine


@pytest.fixture(scope="module")
def machine():
    return load_machine()


def _kind(est, kind):
    return [op for op in est.ops if op.kind == kind]


def _layer_time(est):
    return sum(op.time_s for op in est.ops if op.layer is not None)


def test_seed_calibration_within_15_percent(machine):
    """The acceptance gate of issue 4: Qwen2-7B, INT4 + 38% head sparsity vs the seed's 5.2 ms and 0.21 J."""
    t = estimate_decode(QWEN2_7B, machine, Workload("int4", 0.38, 1024)).totals()
    assert t["ms_per_token"] == pytest.approx(5.2, rel=0.15)
    assert t["j_per_token"] == pytest.approx(0.21, rel=0.15)


def test_bench_reports_the_same_gate(machine, tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "x1_calibration", Path(__file__).parents[1] / "bench" / "x1_calibration.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cal.json"
    assert bench.main(["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gate"]["passed"] and result["machine"]["hash"] == machine.hash
    rows = {r["config"]: r for r in result["rows"]}
    fp16 = rows["X1 FP16 dense"]["ms_per_token"]
    dram = rows["X1 INT4 + 38%, weights in LPDDR5X"]["ms_per_token"]
    assert 3.0 < fp16 / rows["X1 INT4 dense"]["ms_per_token"] < 4.0  # ~16 / 4.25 bits per weight
    assert 50 < dram < 70  # the anchors' LPDDR5X roofline: ~54-66 ms/token


def test_doubling_layers_doubles_layer_time_and_energy(machine):
    wl = Workload("int4", 0.0, 512)
    base = estimate_decode(QWEN2_7B, machine, wl)
    deep = estimate_decode(dataclasses.replace(QWEN2_7B, layers=56), machine, wl)
    assert _layer_time(deep) == pytest.approx(2 * _layer_time(base), rel=0.02)
    assert deep.time_s / base.time_s == pytest.approx(2.0, rel=0.1)  # LM head is the only fixed part
    layer_e = lambda e: sum(op.energy_j for op in e.ops if op.layer is not None)  # noqa: E731
    assert layer_e(deep) == pytest.approx(2 * layer_e(base), rel=0.02)


def test_int4_moves_a_quarter_of_fp16_weight_bytes(machine):
    int4 = estimate_decode(QWEN2_7B, machine, Workload("int4", 0.0, 256))
    fp16 = estimate_decode(QWEN2_7B, machine, Workload("fp16", 0.0, 256))
    n = machine.numerics
    scale_overhead = (4 + n.scale_bits / n.weight_group_size) / 4  # 4.25 / 4
    ratio = int4.bytes_moved("near_memory_read_bit") / fp16.bytes_moved("near_memory_read_bit")
    assert ratio == pytest.approx(0.25 * scale_overhead, rel=1e-9)
    payload = int4.bytes_moved("near_memory_read_bit") / scale_overhead
    assert payload == pytest.approx(QWEN2_7B.linear_params() / 2 + QWEN2_7B.hidden / 2, rel=1e-9)
    for kind in ("gate_proj", "down_proj", "lm_head"):  # decode GEMVs are bound by the weight stream
        assert all(op.bound == "memory" for op in _kind(int4, kind) + _kind(fp16, kind))
    assert 3.0 < fp16.time_s / int4.time_s < 4.0


def test_head_sparsity_saves_attention_and_q_o_but_never_kv_append(machine):
    dense = estimate_decode(QWEN2_7B, machine, Workload("int4", 0.0, 2048))
    sparse = estimate_decode(QWEN2_7B, machine, Workload("int4", 0.5, 2048))
    t = lambda e, k: sum(op.time_s - op.overhead_s for op in _kind(e, k))  # noqa: E731
    c = lambda e, k, a: sum(op.counts.get(a, 0) for op in _kind(e, k))  # noqa: E731
    for kind in ("attn_scores", "attn_values", "softmax", "q_proj", "o_proj"):
        assert t(sparse, kind) < t(dense, kind), kind
    assert c(sparse, "attn_scores", "sram_read_bit") == pytest.approx(0.5 * c(dense, "attn_scores", "sram_read_bit"))
    assert c(sparse, "q_proj", "near_memory_read_bit") == pytest.approx(
        0.5 * c(dense, "q_proj", "near_memory_read_bit")
    )
    for kind in ("k_proj", "v_proj", "kv_append"):  # K and V are still computed and appended
        assert [o.counts for o in _kind(sparse, kind)] == [o.counts for o in _kind(dense, kind)], kind
        assert t(sparse, kind) == t(dense, kind)
    for kind in ("gate_proj", "up_proj", "down_proj", "lm_head"):
        assert t(sparse, kind) == t(dense, kind)
    assert sparse.time_s < dense.time_s and sparse.energy_j < dense.energy_j


def test_kv_cache_spills_to_dram_only_when_it_outgrows_the_banks(machine):
    per_token = kv_placement(QWEN2_7B, machine, 1).bytes_per_token
    assert per_token == pytest.approx(2 * 4 * 128 * 4.25 / 8)  # K and V, 4 KV heads, INT4 + FP16 scale per 64
    window = kv_placement(QWEN2_7B, machine, 1).window
    assert window == int(machine.kv_sram_bytes / QWEN2_7B.layers // per_token)
    fits = estimate_decode(QWEN2_7B, machine, Workload("int4", 0.0, window))
    spills = estimate_decode(QWEN2_7B, machine, Workload("int4", 0.0, window + 1000))
    assert fits.kv.spilled == 0 and spills.kv.spilled == 1000 and spills.kv.resident == window
    dram = lambda e, k: sum(op.counts.get("dram_read_bit", 0) for op in _kind(e, k))  # noqa: E731
    assert dram(fits, "attn_scores") == 0
    assert dram(spills, "attn_scores") == pytest.approx(
        QWEN2_7B.layers * QWEN2_7B.kv_heads * 1000 * QWEN2_7B.head_dim * machine.kv_bits
    )
    assert all(op.counts.get("dram_write_bit", 0) > 0 for op in _kind(spills, "kv_append"))  # eviction
    assert spills.time_s > fits.time_s


def test_weights_beyond_near_memory_stream_from_dram(machine):
    content = copy.deepcopy(machine.content)
    content["near_memory"]["capacity_gib"] = 2.0  # half of a 7B INT4 model
    small = Machine.from_dict(content)
    est = estimate_decode(QWEN2_7B, small, Workload("int4", 0.0, 256))
    total = est.totals()
    assert total["weights_from_dram_bytes"] == pytest.approx(total["weight_bytes_per_token"] - 2 * 2**30, rel=0.01)
    assert est.time_s > 5 * estimate_decode(QWEN2_7B, machine, Workload("int4", 0.0, 256)).time_s


def test_small_models_and_tables(machine):
    tiny = estimate_decode(describe("radreport-tiny"), machine, Workload("int4", 0.0, 128))
    smol = estimate_decode(SMOLLM2_135M, machine, Workload("int4", 0.0, 1024))
    assert 0 < tiny.time_s < smol.time_s < estimate_decode(QWEN2_7B, machine, Workload()).time_s
    rows = tiny.by_kind()
    assert sum(r["time_pct"] for r in rows) == pytest.approx(100)
    assert {r["bound"] for r in rows} <= {"memory", "compute", "dispatch"}
    assert len(tiny.per_layer()) == describe("radreport-tiny").layers + 1
    json.dumps(tiny.to_dict())  # JSON-ready


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"weights": "int3"}, "weights"),
        ({"head_sparsity": 1.0}, "head_sparsity"),
        ({"head_sparsity": -0.1}, "head_sparsity"),
        ({"context": 0}, "context"),
    ],
)
def test_bad_workload_is_refused_by_name(kwargs, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        Workload(**kwargs)


def test_model_shapes_resolve_and_bad_ones_are_refused(tmp_path):
    assert describe("qwen2-7b").linear_params() == pytest.approx(7.07e9, rel=0.01)
    hf = tmp_path / "config.json"
    hf.write_text(
        json.dumps(
            {
                "hidden_size": 576,
                "num_hidden_layers": 30,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "intermediate_size": 1536,
                "vocab_size": 49152,
                "tie_word_embeddings": True,
            }
        )
    )
    assert dataclasses.replace(describe(str(tmp_path)), name="smollm2-135m") == SMOLLM2_135M
    hf.write_text(json.dumps({"hidden_size": 576}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        describe(str(hf))
    with pytest.raises(ConfigError, match="unknown model"):
        describe("llama-999b")
    with pytest.raises(ConfigError, match="kv_heads"):
        dataclasses.replace(QWEN2_7B, kv_heads=5)


def test_cli_estimate_table_and_json(machine, tmp_path):
    from edgekit.cli.x1_cmd import app

    runner = CliRunner()
    r = runner.invoke(
        app, ["estimate", "qwen2-7b", "--weights", "int4", "--head-sparsity", "0.38", "--context", "1024", "--json"]
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["machine"]["hash"] == machine.hash
    assert d["totals"]["ms_per_token"] == pytest.approx(5.2, rel=0.15)
    assert {row["op"] for row in d["by_kind"]} >= {"q_proj", "kv_append", "attn_scores", "lm_head"}
    r = runner.invoke(app, ["estimate", "radreport-tiny"], terminal_width=200)
    assert r.exit_code == 0 and "ms/token" in r.output and "bound" in r.output
    bad = tmp_path / "m.toml"
    bad.write_text("[clock]\nghz = 1.0\n")
    r = runner.invoke(app, ["estimate", "--machine", str(bad)])
    assert isinstance(r.exception, ConfigError) and "missing field 'machine'" in str(r.exception)
