"""The X1 emulator: integer kernels against numpy references, the compiled decoder against ONNX Runtime, and the
KV spill path (same results as a cache that fits; eviction and reload are counted)."""

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgekit.targets.x1.compiler import compile_model
from edgekit.targets.x1.emulator import Emulator
from edgekit.targets.x1.kernels import IntGemm, quantize_groups_int4, dequantize_groups, quantize_rows_int8
from edgekit.targets.x1.machine import Machine, load_machine


def tiny_int4_dir(root: Path) -> Path:
    from edgekit.daemon.testing import write_tiny_model
    from edgekit.export import export_default
    from edgekit.passes.pipeline import run_pipeline
    from edgekit.passes.registry import make_pass

    model = write_tiny_model(root / "model")
    export_default(model, root / "onnx")
    run_pipeline(root / "onnx", root / "int4", [make_pass("int4:block=16,target=x1")], overwrite=True)
    return root / "int4"


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    return tiny_int4_dir(tmp_path_factory.mktemp("x1e"))


def test_int4_gemm_matches_dequantized_matmul():
    rng = np.random.default_rng(0)
    k, n, g = 96, 40, 32
    q = rng.integers(-8, 8, (k, n)).astype(np.float32)
    s16 = (rng.random((n, k // g)) * 0.05 + 0.01).astype(np.float16)
    x = rng.standard_normal((5, k)).astype(np.float32)
    got = IntGemm(q, s16, g)(x)
    qa, a_s = quantize_rows_int8(x)
    w = q * np.repeat(s16.astype(np.float32).T, g, axis=0)  # dequantized (K, N)
    ref = (qa * a_s) @ w  # the same integers, float math
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)  # FP16 output rounding
    # against the unquantized activations: INT8 activations cost < 1% relative error
    assert np.linalg.norm(got - x @ w) / np.linalg.norm(x @ w) < 0.01
    qa_int = qa.reshape(5, k // g, g)
    acc = np.einsum("mgk,gkn->gmn", qa_int.astype(np.int64), q.reshape(k // g, g, n).astype(np.int64))
    exact = np.zeros((5, n), np.float32)
    for j in range(k // g):  # numerics.md: INT32 per group, then FP32 rescale in increasing j
        exact += acc[j].astype(np.float32) * (s16[:, j].astype(np.float32)[None] * a_s)
    np.testing.assert_array_equal(got, exact.astype(np.float16).astype(np.float32))


def test_kv_int4_groups_round_trip():
    x = np.random.default_rng(1).standard_normal((1, 2, 7, 64)).astype(np.float32)
    q, s = quantize_groups_int4(x, 64)
    assert q.dtype == np.int8 and q.min() >= -8 and q.max() <= 7 and s.dtype == np.float16
    err = np.abs(dequantize_groups(q, s, 64) - x).max(axis=-1)
    assert np.all(err <= s.astype(np.float32)[..., 0] / 2 + 1e-6)


def _feeds(rng, seq, hidden, layers, kvh, hd, past=0):
    f = {"inputs_embeds": rng.standard_normal((1, seq, hidden)).astype(np.float32),
         "attention_mask": np.ones((1, past + seq), np.int64),
         "position_ids": np.arange(past, past + seq)[None].astype(np.int64)}
    for i in range(layers):
        f[f"past_key_values.{i}.key"] = np.zeros((1, kvh, 0, hd), np.float32)
        f[f"past_key_values.{i}.value"] = np.zeros((1, kvh, 0, hd), np.float32)
    return f


def _greedy(step, embed_table, first, n):
    """Feed back the embedding of the argmax token n times; returns the token ids."""
    out, past = [], None
    logits, past = step(first, past, first["inputs_embeds"].shape[1])
    pos = first["inputs_embeds"].shape[1]
    for _ in range(n):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        feeds = {"inputs_embeds": embed_table[tok % len(embed_table)][None, None], "attention_mask": np.ones((1, pos + 1), np.int64),
                 "position_ids": np.array([[pos]], np.int64)}
        logits, past = step(feeds, past, 1)
        pos += 1
    return out


def test_compiled_decoder_matches_onnx_runtime(int4_dir):
    m = load_machine()
    emu = Emulator(compile_model(int4_dir, m), m)
    sess = ort.InferenceSession(str(int4_dir / "decoder_model_merged.onnx"))
    names = [o.name for o in sess.get_outputs()]
    layers, kvh, hd = emu.layers, emu.kv_heads, emu.head_dim
    rng = np.random.default_rng(3)
    f = _feeds(rng, 6, 48, layers, kvh, hd)
    ref = dict(zip(names, sess.run(None, f)))
    got = emu.run("decoder", f)
    a, b = got.outputs["logits"].ravel(), ref["logits"].ravel()
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999
    k_ref, k_got = ref["present.1.key"], got.outputs["present.1.key"]
    assert k_got.shape == k_ref.shape and np.abs(k_got - k_ref).max() < 0.2 * np.abs(k_ref).max()
    # greedy decoding with a scaled-up embedding table (peaked logits): token for token identical
    table = rng.standard_normal((64, 48)).astype(np.float32) * 3

    def ort_step(feeds, past, seq):
        full = dict(feeds)
        for i in range(layers):
            pk, pv = past[i] if past else (np.zeros((1, kvh, 0, hd), np.float32),) * 2
            full[f"past_key_values.{i}.key"], full[f"past_key_values.{i}.value"] = pk, pv
        out = dict(zip(names, sess.run(None, full)))
        return out["logits"], [(out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(layers)]

    def emu_step(feeds, past, seq):
        r = emu.run("decoder", feeds, kv_state=past if past is not None else emu.new_kv(), want_present=False)
        return r.outputs["logits"], r.kv_state

    first = _feeds(rng, 4, 48, layers, kvh, hd)
    first["inputs_embeds"] *= 3
    assert _greedy(emu_step, table, first, 12) == _greedy(ort_step, table, first, 12)
    assert got.totals["cycles"] > 0 and got.totals["energy_j"] > 0
    rec = got.records[0]
    assert {"index", "mnemonic", "queue", "bound", "energy_pj"} <= set(vars(rec))


def test_head_mask_zeroes_skipped_heads_and_saves_time(int4_dir):
    m = load_machine()
    emu = Emulator(compile_model(int4_dir, m), m)
    f = _feeds(np.random.default_rng(4), 3, 48, emu.layers, emu.kv_heads, emu.head_dim)
    dense = emu.run("decoder", f, capture={"/model/layers.0/self_attn/MatMul_1_output_0"})
    mask = np.ones((emu.layers, emu.heads), bool)
    mask[0, 1] = mask[1, 3] = False
    sparse = emu.run("decoder", f, head_mask=mask, capture={"/model/layers.0/self_attn/MatMul_1_output_0"})
    o = sparse.captured["/model/layers.0/self_attn/MatMul_1_output_0"]  # (b, kv, group, s, hd)
    assert np.all(o.reshape(1, emu.heads, 3, -1)[0, 1] == 0)
    assert np.any(dense.captured["/model/layers.0/self_attn/MatMul_1_output_0"].reshape(1, emu.heads, 3, -1)[0, 1])
    assert np.isnan(sparse.head_norms[0, 1]) and not np.isnan(dense.head_norms).any()
    assert sparse.totals["cycles"] < dense.totals["cycles"]


def _small_kv_machine(m: Machine) -> Machine:
    c = {k: dict(v) for k, v in m.content.items()}
    c["sram"].update(banks=4, kv_banks=1, bank_kib=1.0)  # 1 KiB of KV: a window of 20 tokens per layer here
    return Machine.from_dict(c)


def test_kv_spill_gives_identical_results_and_counts_dram(int4_dir):
    big = load_machine()
    small = _small_kv_machine(big)
    runs = {}
    for name, m in (("big", big), ("small", small)):
        emu = Emulator(compile_model(int4_dir, m), m)
        rng = np.random.default_rng(5)
        f = _feeds(rng, 16, 48, emu.layers, emu.kv_heads, emu.head_dim)
        r = emu.run("decoder", f, kv_state=emu.new_kv(), want_present=False)
        logits, recs, kv = [r.outputs["logits"]], list(r.records), r.kv_state
        for step in range(10):
            pos = 16 + step
            feeds = {"inputs_embeds": rng.standard_normal((1, 1, 48)).astype(np.float32),
                     "attention_mask": np.ones((1, pos + 1), np.int64), "position_ids": np.array([[pos]])}
            r = emu.run("decoder", feeds, kv_state=kv, want_present=False)
            logits.append(r.outputs["logits"])
            recs += r.records
            kv = r.kv_state
        runs[name] = (emu.window, logits, recs, kv)
    assert runs["big"][0] > 1000 and runs["small"][0] == 20
    for a, b in zip(runs["big"][1], runs["small"][1]):
        np.testing.assert_array_equal(a, b)
    kv_small = runs["small"][3]
    assert kv_small.length(0) == (20, 6)  # 26 positions: 20 resident, 6 spilled to DRAM
    mn = {r.mnemonic for r in runs["small"][2]}
    assert {"KVEVICT", "KVLD"} <= mn and not {"KVEVICT", "KVLD"} & {r.mnemonic for r in runs["big"][2]}
    dram = sum(r.energy_pj.get("dram_read_bit", 0) for r in runs["small"][2] if r.mnemonic == "KVLD")
    assert dram > 0
    loads = [r for r in runs["small"][2] if r.mnemonic == "KVLD"]
    assert all(r.queue == "LOAD" for r in loads)
