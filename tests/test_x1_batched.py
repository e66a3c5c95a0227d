"""x1 rows and batched decode (`X1Backend` as the engine's `SlotBackend`, `batch_step`): rows decoded together
get the tokens and head masks they get alone; one step streams the weights once and its cost adds up over the
rows; a released row hands back its own cost.

On the daemon's tiny random model built for x1 (programs compiled for the default machine), with DSS pushed to
skip (every head a candidate) so that per-row head masks are exercised; the emulator-level tests compile the same
decoder for a machine whose KV cache spills, so the shared step also merges spilled-KV loads and evictions."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from edgekit.bundle import load_bundle
from edgekit.engine import Engine, Request
from edgekit.errors import ConfigError
from edgekit.generate import GenerationOptions
from edgekit.targets.x1.backend import X1Backend
from edgekit.targets.x1.batch_step import WEIGHT_ACTIONS, step_cost

from x1_support import small_kv_machine

SKIPPING = {"sensitivity_threshold": 1.0}  # every head a candidate: DSS skips its whole budget


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from edgekit.build import build
    from edgekit.daemon.testing import write_tiny_model

    root = tmp_path_factory.mktemp("x1rows")
    build("x1", root / "b", model_dir=write_tiny_model(root / "model", max_new_tokens=16), parity=False)
    return root / "b"


@pytest.fixture(scope="module")
def backend(bundle):
    return X1Backend(bundle, settings=SKIPPING)


def _requests(vocab: int, n: int = 6) -> list[Request]:
    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        pixels = rng.uniform(-1, 1, (2, 1, 32, 32)).astype(np.float32) if i % 2 == 0 else None
        out.append(
            Request(
                rng.integers(5, vocab, 3 + 3 * i),
                GenerationOptions(max_new_tokens=(14, 6, 11, 9, 16, 4)[i % 6]),
                pixels,
                image_slot=1 if pixels is not None else 0,
            )
        )
    return out


def _alone(backend, req: Request):
    engine = Engine(backend, max_batch=1)
    ticket = engine.submit(req)
    engine.run()
    return ticket.result()


def _vocab(backend) -> int:
    return int(backend.programs["decoder"].io["outputs"][0]["shape"][-1])


# --- through the engine --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_rows_decoded_together_get_the_tokens_and_head_masks_they_get_alone(backend, prefill_chunk):
    reqs = _requests(_vocab(backend))
    alone = [_alone(backend, r) for r in reqs]
    engine = Engine(backend, max_batch=4, prefill_chunk=prefill_chunk)
    first = [engine.submit(r) for r in reqs[:4]]
    for _ in range(5):  # the first four decode while the others wait for rows
        engine.step()
    tickets = first + [engine.submit(r) for r in reqs[4:]]
    engine.run()
    together = [t.result() for t in tickets]
    assert [r.token_ids for r in together] == [a.token_ids for a in alone]
    assert [r.cost["dss"] for r in together] == [a.cost["dss"] for a in alone]  # each row its own policy
    assert all(a.cost["dss"]["heads_skipped"] > 0 for a in alone if len(a.token_ids) > 2)
    assert max(rows for rows, _, _ in engine.stats.recent) >= 3  # rows really shared steps
    assert max(r.cost["decode_batch_mean"] for r in together) > 2


def test_without_kv_caching_rows_recompute_their_own_sequences(bundle):
    be = X1Backend(bundle, settings={"kv_caching": False})
    reqs = _requests(_vocab(be), 4)
    alone = [_alone(be, r).token_ids for r in reqs]
    engine = Engine(be, max_batch=4)
    tickets = [engine.submit(r) for r in reqs]
    engine.run()
    assert [t.result().token_ids for t in tickets] == alone


def test_energy_per_token_falls_at_batch_8_and_rows_are_billed_their_part(backend):
    rng = np.random.default_rng(5)
    reqs = [Request(rng.integers(5, _vocab(backend), 6), GenerationOptions(max_new_tokens=12)) for _ in range(8)]
    alone = [_alone(backend, r).cost for r in reqs]
    engine = Engine(backend, max_batch=8)
    tickets = [engine.submit(r) for r in reqs]
    engine.run()
    together = [t.result().cost for t in tickets]
    for a, b in zip(alone, together):
        assert a["decode_batch_mean"] == 1.0 and a["latency_ms"] == a["emulated_ms_total"]
        assert 0 < b["mj_per_token"] < a["mj_per_token"] / 2  # the weight stream and the dispatches are shared
        assert 0 < b["emulated_ms_per_token"] < a["emulated_ms_per_token"]
        assert b["energy_j"] > 0 and b["latency_ms"] > b["emulated_ms_total"]  # it waited for whole steps
        # the eight 6-token prompts prefill in one machine run: each row billed its part of it
        assert b["phases"]["prefill"]["calls"] == a["phases"]["prefill"]["calls"] == 1
        assert 0 < b["phases"]["prefill"]["mj"] < a["phases"]["prefill"]["mj"] / 2
    # the engine's bandwidth rule reads the emulated step: bytes off chip over emulated seconds
    rows, seconds, moved = engine.stats.recent[-1]
    assert seconds == backend.last_step_seconds < 1e-3 and moved == backend.last_step_bytes > 0


def test_first_prompts_prefilled_together_are_one_machine_prefill(backend):
    """`prefill_rows`: each row's logits those of its own `prefill`; billed as one prefill whose weights stream once
    (the rows' parts add up to less than their prefills alone), and one row's exactly its own prefill."""
    x = backend.embed(np.arange(5, 29).reshape(3, 8), [0, 1, 2])
    pos = np.tile(np.arange(8), (3, 1))
    alone, alone_mj = [], []
    for i in range(3):
        alone.append(backend.prefill(i, x[i : i + 1], pos[:1]))
    for i in range(3):
        alone_mj.append(backend.release(i)["phases"]["prefill"]["mj"])
    together = backend.prefill_rows([0, 1, 2], x, pos)
    np.testing.assert_array_equal(together, np.stack(alone))
    parts = [backend.release(i)["phases"]["prefill"] for i in range(3)]
    assert all(p["calls"] == 1 for p in parts)
    assert sum(p["mj"] for p in parts) < 0.6 * sum(alone_mj)
    one = backend.prefill_rows([4], x[:1], pos[:1])
    np.testing.assert_array_equal(one[0], alone[0])
    assert backend.release(4)["phases"]["prefill"]["mj"] == pytest.approx(alone_mj[0], rel=1e-12)
    backend.prefill(5, x[:1, :3], pos[:1, :3])
    with pytest.raises(ConfigError, match="new rows only"):
        backend.prefill_rows([5, 6], x[:2], pos[:2])
    backend.release(5)
    backend.release(6)


def test_release_returns_the_rows_cost_and_a_reused_row_starts_afresh(backend):
    x = backend.embed(np.arange(5, 12)[None], [0])
    first = backend.prefill(0, x, np.arange(7)[None])
    for pos in range(7, 10):
        backend.step([0], backend.embed(np.array([[9]]), [0]), np.array([[pos]]))
    cost = backend.release(0)
    assert cost["decode_steps"] == 3 and cost["phases"]["prefill"]["calls"] == 1 and cost["mj_total"] > 0
    assert cost["phases"]["embed"]["calls"] == 4 and cost["dss"]["tokens"] == 3
    assert backend.release(0) == {}  # forgotten
    again = backend.prefill(0, backend.embed(np.arange(5, 12)[None], [0]), np.arange(7)[None])
    assert np.array_equal(again, first)  # an empty cache, not the old one
    fresh = backend.release(0)
    assert fresh["phases"]["prefill"] == cost["phases"]["prefill"] and fresh["decode_steps"] == 0
    assert backend.take_cost()["mj_total"] == 0.0  # rows never bill the one-sequence protocol


def test_the_engine_is_told_the_rows_kv_bytes_and_the_bandwidth_limit(backend):
    m = backend.machine
    per_token_layer = 2 * backend.kv_heads * backend.head_dim * (4 + 16 / 64) / 8  # INT4 + an FP16 scale per 64
    assert backend.kv_bytes_per_token == int(np.ceil(backend.num_layers * per_token_layer))
    assert backend.bandwidth_limit_bytes_per_s == m.near_memory_bandwidth + m.dram_bandwidth
    assert Engine(backend, max_batch=16).max_batch == backend.max_rows == 8


def test_reports_written_together_equal_reports_written_alone_on_an_eval_split(bundle):
    from edgekit.models.synth import write_split
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    data = bundle.parent / "eval"
    write_split(data, "test", 6)
    studies = [json.loads(line) for line in (data / "studies.jsonl").read_text().splitlines()]
    reporter = Reporter(load_bundle(bundle), runtime=RuntimeOptions(settings=SKIPPING))

    def report(s):
        return reporter.report(data / s["path"], s.get("indication", ""))

    alone = [report(s) for s in studies]
    with ThreadPoolExecutor(len(studies)) as pool:
        together = list(pool.map(report, studies))
    reporter.close()
    assert [r.text for r in together] == [r.text for r in alone]
    assert [r.cost["dss"] for r in together] == [r.cost["dss"] for r in alone]
    assert sum(r.energy_j for r in together) < sum(r.energy_j for r in alone)


# --- the shared step, on the emulator ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spill_emu(bundle):
    """The tiny decoder compiled for a machine whose KV banks hold 20 tokens per layer: longer rows spill."""
    from edgekit.targets.x1.compiler import compile_graph
    from edgekit.targets.x1.emulator import Emulator
    from edgekit.targets.x1.machine import load_machine

    machine = small_kv_machine(load_machine())
    program = compile_graph(load_bundle(bundle).component("decoder"), machine, graph_name="decoder")
    return Emulator({"decoder": program}, machine)


def _row_runs(emu, lengths, masks, seed=3):
    """One decode token for each row after a prefill of `lengths[i]` tokens, with `masks[i]`."""
    rng = np.random.default_rng(seed)
    hidden = emu.prepared["decoder"].program.io["inputs"][0]["shape"][-1]
    runs = []
    for n, mask in zip(lengths, masks):
        kv = emu.new_kv()
        for pos, size in ((0, n), (n, 1)):
            feeds = {
                "inputs_embeds": rng.standard_normal((1, size, hidden)).astype(np.float32),
                "attention_mask": np.ones((1, pos + size), np.int64),
                "position_ids": np.arange(pos, pos + size)[None],
            }
            r = emu.run("decoder", feeds, kv_state=kv, want_present=False, head_mask=mask if size == 1 else None)
            kv = r.kv_state
        runs.append(r)
    return runs


def _weight_j(emu, run) -> float:
    pj = {a: emu.machine.energy[a].pj for a in WEIGHT_ACTIONS}
    return (
        sum(
            e.cost.counts.get(a, 0.0) * pj[a]
            for st, _, e in run.entries
            if st.mnemonic.startswith("XL_GEMM")
            for a in pj
        )
        * 1e-12
    )


def _mask(emu, *skipped):
    m = np.ones((emu.layers, emu.heads), bool)
    for layer, head in skipped:
        m[layer, head] = False
    return m


@pytest.mark.parametrize("length", [6, 40])  # resident, and spilled (a LOAD-queue read and an eviction per layer)
def test_a_step_of_one_row_is_exactly_that_rows_run(spill_emu, length):
    mask = _mask(spill_emu, (0, 1), (1, 2))
    (run,) = _row_runs(spill_emu, [length], [mask])
    step = step_cost(spill_emu, "decoder", [run], [mask])
    t = run.totals
    assert (step.cycles, step.seconds, step.energy_j) == (t["cycles"], t["seconds"], t["energy_j"])
    assert step.row_seconds == (step.seconds,) and step.row_energy_j == (step.energy_j,)
    assert any(st.mnemonic == "KVLD" for st, _, _ in run.entries) == (length > 20)


def test_a_shared_step_streams_the_weights_once_and_its_rows_parts_add_up(spill_emu):
    lengths = [6, 40, 12, 33]
    runs = _row_runs(spill_emu, lengths, [None] * 4)
    step = step_cost(spill_emu, "decoder", runs, [None] * 4)
    one = _weight_j(spill_emu, runs[0])
    assert step.weight_energy_j == pytest.approx(one, rel=1e-12)  # not 4x: streamed once
    assert max(r.totals["seconds"] for r in runs) < step.seconds < sum(r.totals["seconds"] for r in runs)
    assert step.energy_j < sum(r.totals["energy_j"] for r in runs)
    assert sum(step.row_seconds) == pytest.approx(step.seconds, rel=1e-12)
    assert sum(step.row_energy_j) == pytest.approx(step.energy_j, rel=1e-12)
    # the shared part evenly, each row's own attention over its cache to itself: longer rows pay more
    assert step.row_energy_j[1] > step.row_energy_j[3] > step.row_energy_j[2] > step.row_energy_j[0] > 0
    assert step.off_chip_bytes > 0


def test_under_dss_a_head_is_streamed_when_any_row_computes_it(spill_emu):
    a, b = _mask(spill_emu, (0, 1), (1, 2)), _mask(spill_emu, (0, 3), (1, 0))
    dense = step_cost(spill_emu, "decoder", _row_runs(spill_emu, [6, 6], [None, None]), [None, None])
    same = step_cost(spill_emu, "decoder", _row_runs(spill_emu, [6, 6], [a, a]), [a, a])
    apart = step_cost(spill_emu, "decoder", _row_runs(spill_emu, [6, 6], [a, b]), [a, b])
    alone_a = _weight_j(spill_emu, _row_runs(spill_emu, [6], [a])[0])
    assert same.weight_energy_j == pytest.approx(alone_a, rel=1e-12)
    assert same.weight_energy_j < dense.weight_energy_j
    assert apart.weight_energy_j == pytest.approx(dense.weight_energy_j, rel=1e-12)  # no head skipped by both
