"""The cpu target's fused decoder (`targets/cpu/fused.py`) and its slot backend (`targets/cpu/slots.py`) against
the portable decoder served by `CpuBackend`, on radreport-tiny and on random-init Hugging Face decoders.

Tolerances, per model, on the logits of the last position of a prompt and of each teacher-forced decode step
(max |fused - portable| / max |portable|):
- float32 graphs: 1e-4. Same math in another order (GroupQueryAttention's softmax, fused RMSNorm, packed QKV);
  measured 2e-6 on radreport-tiny and 1e-6 on the tiny HF decoders;
- INT4 graphs at `accuracy_level` 0 (both dequantize to float32): 1e-4 as well;
- INT4 graphs at `accuracy_level` 4, what the target ships (int8 activations per block): 2e-2 (measured 8e-3 on
  radreport-tiny's int4 recipe); greedy tokens are still identical on the trained radreport-tiny.
Greedy tokens through the engine (`edgekit.generate`) are identical to the portable decoder's in every float
case: one step batched with rows at different lengths, chunked prefill, rows leaving and capacity growth included.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from edgekit import names
from edgekit.engine import Engine, Request
from edgekit.errors import ConfigError, ContextExceededError
from edgekit.generate import GenerationOptions, generate, generate_batch
from edgekit.ort import CpuBackend
from edgekit.positions import MROPE, PositionScheme
from edgekit.targets.cpu.build import model_positions
from edgekit.targets.cpu.fused import FUSED_ROLE, ROPE_POSITIONS, NotPortable, lower_decoder
from edgekit.targets.cpu.kv_buffers import KvBuffers
from edgekit.targets.cpu.slots import CpuSlotBackend

FLOAT_TOL = 1e-4
RR_POSITIONS = 256  # radreport-tiny's context (its config's max_positions): the build's RoPE table rows
INT8_ACTIVATIONS_TOL = 2e-2


# helpers ----------------------------------------------------------------------------------------------------
def _lower(graphs: Path, out: Path, **options) -> Path:
    model = ir.load(graphs / names.DECODER)
    lower_decoder(model, **options)
    out.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, out)
    return out


def _vision(graphs: Path) -> Path | None:
    path = graphs / names.VISION_ENCODER
    return path if path.is_file() else None


def _portable(graphs: Path) -> CpuBackend:
    return CpuBackend(_vision(graphs), graphs / names.EMBED_TOKENS, graphs / names.DECODER, intra_op_threads=1)


def _fused(graphs: Path, decoder: Path, **kw) -> CpuSlotBackend:
    return CpuSlotBackend(decoder, graphs / names.EMBED_TOKENS, _vision(graphs), intra_op_threads=1, **kw)


def _teacher_forced(portable: CpuBackend, fused: CpuSlotBackend, embeds, positions, steps: int = 6) -> float:
    """Prefill `embeds` on both, then `steps` decode steps fed the portable decoder's greedy tokens; the largest
    logit difference relative to the largest portable logit."""
    n = embeds.shape[1]
    want, past = portable.decode(embeds, np.ones((1, n), np.int64), positions, None)
    got = fused.prefill(0, embeds, positions)
    errors, scale = [], 0.0
    next_pos = int(positions.max()) + 1
    for i in range(steps + 1):
        errors.append(np.abs(want[0, -1] - got).max())
        scale = max(scale, np.abs(want[0, -1]).max())
        if i == steps:
            break
        x = portable.embed(np.array([[int(want[0, -1].argmax())]]))
        p = np.full((3, 1, 1) if positions.ndim == 3 else (1, 1), next_pos + i)
        want, past = portable.decode(x, np.ones((1, n + i + 1), np.int64), p, past)
        got = fused.step([0], x, p)[0]
    fused.release(0)
    return float(max(errors) / scale)


def _tokens(backend, pixels, prompts, new=24, **kw) -> list[list[int]]:
    return [r.token_ids for r in generate_batch(backend, pixels, prompts, GenerationOptions(max_new_tokens=new), **kw)]


# models -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def radreport(tmp_path_factory):
    """radreport-tiny's trained weights, exported as the cpu target receives them (float32)."""
    from edgekit.build import default_model_dir
    from edgekit.export import export_default

    out = tmp_path_factory.mktemp("radreport")
    export_default(default_model_dir(), out / "graphs")
    return out / "graphs", _lower(out / "graphs", out / "decoder_cpu.onnx", max_positions=RR_POSITIONS)


@pytest.fixture(scope="module")
def radreport_int4(radreport, tmp_path_factory):
    """The int4 recipe's graphs (INT4 RTN, LM head at 8 bits), lowered at accuracy_level 0 and 4."""
    from edgekit.passes import run_pipeline
    from edgekit.passes.recipe import load_recipe

    out = tmp_path_factory.mktemp("radreport-int4")
    run_pipeline(radreport[0], out / "graphs", load_recipe("int4").passes, check=False)
    return out / "graphs", {
        level: _lower(
            out / "graphs", out / f"decoder_cpu_{level}.onnx", accuracy_level=level, max_positions=RR_POSITIONS
        )
        for level in (0, 4)
    }


def _rr_inputs(backend, rng, rows=1, prompt=10):
    pixels = rng.uniform(-1, 1, (rows, 8, 1, 64, 64)).astype(np.float32)
    return pixels, rng.integers(5, 500, (rows, prompt))


# the lowering -----------------------------------------------------------------------------------------------
def test_fused_graph_is_contrib_ops_over_an_in_place_cache(radreport):
    graphs, fused = radreport
    model = ir.load(fused)
    ops = [(n.domain, n.op_type) for n in model.graph]
    layers = 4
    assert ops.count(("com.microsoft", "GroupQueryAttention")) == layers
    assert ops.count(("com.microsoft", "SkipSimplifiedLayerNormalization")) == 2 * layers  # all but the first norm
    assert ops.count(("", "SimplifiedLayerNormalization")) == 1
    assert not any("self_attn/Concat" in n.name for n in model.graph)  # no KV concatenation
    assert ops.count(("", "MatMul")) == layers * 5 + 1  # packed QKV, o, gate, up, down; the LM head
    inputs = [v.name for v in model.graph.inputs]
    assert names.ATTENTION_MASK not in inputs and {"seqlens_k", "total_sequence_length"} <= set(inputs)
    assert [d if isinstance(d, int) else str(d) for d in model.graph.outputs[0].shape] == ["batch", 1, 588]


def test_text_rope_reads_position_tables_and_norms_name_only_what_is_read(radreport, tmp_path):
    """The shipped lowering of a text RoPE: constant cos/sin tables of the model's context, indexed by the
    decoder's own position_ids, so a step runs no angle nodes; the fused norms name only the outputs read (ORT
    computes a named optional output). Without a known context the per-token tables stay, and match as well."""
    graphs, fused = radreport
    model = ir.load(fused)
    assert model.metadata_props[ROPE_POSITIONS] == str(RR_POSITIONS)
    ops = {n.op_type for n in model.graph}
    assert not ops & {"Cos", "Sin", "Range", "Pad"}
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert all(tuple(n.inputs[7].shape) == (RR_POSITIONS, 16) and n.inputs[9].name == names.POSITION_IDS for n in gqa)
    norms = [list(n.output) for n in onnx.load(fused).graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert all(out[1:3] == ["", ""] and out[3] for out in norms[:-1])  # no mean, no deviation; the sum goes on
    assert len(norms[-1]) == 1  # the last sum goes nowhere: only the normed output is named

    per_token = _lower(graphs, tmp_path / "decoder_cpu.onnx")
    assert ROPE_POSITIONS not in ir.load(per_token).metadata_props
    assert {"Cos", "Sin"} <= {n.op_type for n in ir.load(per_token).graph}
    portable = _portable(graphs)
    x = portable.embed(np.random.default_rng(9).integers(5, 500, (1, 12)))
    pos = np.arange(12)[None]
    assert _teacher_forced(portable, _fused(graphs, per_token), x, pos) < FLOAT_TOL


def _angles_graph(opset: int) -> ir.Graph:
    """`Mul(Unsqueeze(Cast(position_ids)), inv_freq)`, the portable export's angles, with the Unsqueeze of `opset`
    (13 and later: axes an input; before: an attribute)."""
    from onnx import TensorProto, helper

    inv = onnx.numpy_helper.from_array(np.asarray([1.0, 0.1], np.float32), "inv_freq")
    cast = helper.make_node("Cast", ["position_ids"], ["pos_f"], to=TensorProto.FLOAT)
    if opset >= 13:
        axes = onnx.numpy_helper.from_array(np.asarray([-1], np.int64), "axes")
        unsq = helper.make_node("Unsqueeze", ["pos_f", "axes"], ["pos_u"])
        inits = [inv, axes]
    else:
        unsq = helper.make_node("Unsqueeze", ["pos_f"], ["pos_u"], axes=[-1])
        inits = [inv]
    mul = helper.make_node("Mul", ["pos_u", "inv_freq"], ["freqs"])
    graph = helper.make_graph(
        [cast, unsq, mul],
        "angles",
        [helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("freqs", TensorProto.FLOAT, ["b", "s", 2])],
        inits,
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])).graph


@pytest.mark.parametrize("opset", [11, 13])
def test_text_angles_are_found_only_where_the_axes_are_an_input(opset):
    from edgekit.targets.cpu.attention import text_angles

    graph = _angles_graph(opset)
    freqs = graph.outputs[0]
    got = text_angles(freqs, graph.inputs[0])
    if opset >= 13:
        assert got is not None and got.tolist() == pytest.approx([1.0, 0.1])
    else:  # axes in an attribute: not recognised, so per-token tables (and no IndexError on a missing input)
        assert got is None


def test_a_row_cannot_grow_past_the_position_tables(radreport):
    graphs, decoder = radreport
    fused = _fused(graphs, decoder, capacity=8)
    x = fused.embed(np.random.default_rng(10).integers(5, 500, (1, RR_POSITIONS + 1)), [0])
    with pytest.raises(ContextExceededError, match=f"{RR_POSITIONS + 1} positions.*context of {RR_POSITIONS}"):
        fused.prefill(0, x, np.arange(RR_POSITIONS + 1)[None])
    fused.prefill(1, x[:, :RR_POSITIONS], np.arange(RR_POSITIONS)[None])  # the whole context fills
    with pytest.raises(ContextExceededError) as err:
        fused.step_tokens([1], [7], [RR_POSITIONS])
    assert err.value.code == "context_exceeded" and err.value.http_status == 422


def test_lowering_refuses_what_it_cannot_read(radreport, tmp_path):
    graphs, fused = radreport
    with pytest.raises(NotPortable, match="already lowered"):
        lower_decoder(ir.load(fused))
    model = ir.load(graphs / names.DECODER)
    rotate = next(n for n in model.graph if n.name == "/model/layers.1/self_attn/rotary_k/Concat")
    a, b = rotate.inputs
    rotate.replace_input_with(0, b)  # concat(x1, -x2): not HF's rotate_half
    rotate.replace_input_with(1, a)
    with pytest.raises(NotPortable, match="layer 1 attention"):
        lower_decoder(model)


# numerical hold ---------------------------------------------------------------------------------------------
def test_radreport_tiny_logits_and_greedy_tokens_match_portable(radreport):
    graphs, decoder = radreport
    portable, fused = _portable(graphs), _fused(graphs, decoder)
    rng = np.random.default_rng(0)
    pixels, ids = _rr_inputs(portable, rng)
    x = np.concatenate([portable.encode_images(pixels), portable.embed(ids)], axis=1)
    assert _teacher_forced(portable, fused, x, np.arange(x.shape[1])[None]) < FLOAT_TOL
    pixels, ids = _rr_inputs(portable, rng, rows=3)
    assert _tokens(fused, pixels, ids, new=40) == _tokens(portable, pixels, ids, new=40)


def test_radreport_int4_at_both_accuracy_levels(radreport_int4):
    graphs, decoders = radreport_int4
    portable = _portable(graphs)
    rng = np.random.default_rng(1)
    pixels, ids = _rr_inputs(portable, rng)
    x = np.concatenate([portable.encode_images(pixels), portable.embed(ids)], axis=1)
    pos = np.arange(x.shape[1])[None]
    assert _teacher_forced(portable, _fused(graphs, decoders[0]), x, pos) < FLOAT_TOL
    shipped = _fused(graphs, decoders[4])
    assert FLOAT_TOL < _teacher_forced(portable, shipped, x, pos) < INT8_ACTIVATIONS_TOL  # int8 activations: not exact
    pixels, ids = _rr_inputs(portable, rng, rows=3)
    assert _tokens(shipped, pixels, ids, new=40) == _tokens(portable, pixels, ids, new=40)


@pytest.fixture(scope="module")
def hf_decoders(tmp_path_factory):
    """Random-init LLaMA, Qwen2 (q/k/v biases) and Mistral checkpoints, converted and lowered."""
    pytest.importorskip("transformers")
    from hf_text_factory import make_text_lm

    from edgekit.hf import convert_hf

    out = {}
    for family in ("llama", "qwen2", "mistral"):
        root = tmp_path_factory.mktemp(family)
        make_text_lm(root / "hf", family, seed=3)
        convert_hf(root / "hf", root / "graphs")
        positions = model_positions(root / "hf")
        assert positions is not None
        out[family] = (
            root / "graphs",
            {
                "position": _lower(root / "graphs", root / "decoder_cpu.onnx", max_positions=positions),
                "token": _lower(root / "graphs", root / "decoder_cpu_token_tables.onnx"),
            },
        )
    return out


@pytest.mark.parametrize("tables", ["position", "token"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_hf_decoders_match_portable(hf_decoders, family, tables):
    """Both kinds of RoPE table: indexed by position (what the build ships for a text RoPE with a known context)
    and each token's own angles (without a context)."""
    graphs, decoders = hf_decoders[family]
    portable, fused = _portable(graphs), _fused(graphs, decoders[tables])
    rng = np.random.default_rng(2)
    ids = rng.integers(5, 160, (1, 12))
    assert _teacher_forced(portable, fused, portable.embed(ids), np.arange(12)[None]) < FLOAT_TOL
    prompts = rng.integers(5, 160, (2, 9))
    assert _tokens(fused, None, prompts) == _tokens(portable, None, prompts)


def test_qwen2_vl_mrope_positions(tmp_path):
    """M-RoPE: three position axes per token (an image span's t/h/w), rotated inside GroupQueryAttention from the
    per-token tables, with positions that differ between the axes and jump after the span."""
    pytest.importorskip("transformers")
    from hf_vlm_factory import make_qwen2_vl

    from edgekit.hf import convert_hf

    make_qwen2_vl(tmp_path / "hf", seed=2)
    convert_hf(tmp_path / "hf", tmp_path / "graphs")
    graphs = tmp_path / "graphs"
    assert PositionScheme.beside(graphs).kind == MROPE
    portable = _portable(graphs)
    lowered = _lower(graphs, tmp_path / "decoder_cpu.onnx", max_positions=4096)  # no position table can do M-RoPE
    assert ROPE_POSITIONS not in ir.load(lowered).metadata_props
    fused = _fused(graphs, lowered)
    text = np.arange(3)
    t, h, w = np.zeros(16, int), np.repeat(np.arange(4), 4), np.tile(np.arange(4), 4)  # a 4 x 4 merged grid
    after = np.arange(7, 12)
    pos = np.stack([np.concatenate([text, 3 + a, after]) for a in (t, h, w)])[:, None]  # (3, 1, 24)
    x = portable.embed(np.random.default_rng(3).integers(5, 150, (1, pos.shape[-1])))
    assert _teacher_forced(portable, fused, x, pos) < FLOAT_TOL
    # the engine's call: a text position written on all three axes, as `PositionScheme.step` makes it
    by_ids = _fused(graphs, tmp_path / "decoder_cpu.onnx")
    for backend in (fused, by_ids):
        backend.prefill(0, x, pos)
    for i, token in enumerate((17, 42, 99)):
        want = fused.step([0], portable.embed(np.array([[token]])), np.full((3, 1, 1), 12 + i))
        np.testing.assert_allclose(by_ids.step_tokens([0], [token], [12 + i]), want, rtol=0, atol=1e-6)
    # a greedy run of two rows writes each row's text position on all three axes, as single steps do
    run, steps = _fused(graphs, lowered), _fused(graphs, lowered)
    for backend in (run, steps):
        backend.prefill(0, x, pos)
        backend.prefill(1, x[:, :10], pos[..., :10])
    got = run.decode_greedy([0, 1], [17, 42], [12, 9], 6, frozenset(), lambda: True)
    want, tokens, at = [], [17, 42], [12, 9]
    for _ in range(6):
        tokens = [int(t) for t in steps.step_tokens([0, 1], tokens, at).argmax(-1)]
        want.append(tokens)
        at = [a + 1 for a in at]
    assert got == want
    # two first prompts at the same M-RoPE positions in one call: row 1 rotated from row 0's positions, exactly
    together = _fused(graphs, lowered)
    y = portable.embed(np.random.default_rng(4).integers(5, 150, (1, pos.shape[-1])))
    got = together.prefill_rows([0, 1], np.concatenate([x, y]), np.concatenate([pos, pos], axis=1))
    want = np.stack([steps.prefill(r, e, pos) for r, e in ((2, x), (3, y))])
    np.testing.assert_array_equal(got, want)


# the engine's rows ------------------------------------------------------------------------------------------
def test_rows_at_different_lengths_in_one_step_decode_as_alone(radreport):
    graphs, decoder = radreport
    fused = _fused(graphs, decoder)
    rng = np.random.default_rng(4)
    pixels, ids = _rr_inputs(fused, rng, rows=3, prompt=14)
    mask = np.ones_like(ids)
    mask[1, :9], mask[2, :4] = 0, 0  # prompts of 14, 5 and 10 tokens
    together = _tokens(fused, pixels, ids, prompt_attention_mask=mask)
    alone = [_tokens(fused, pixels[i : i + 1], ids[i : i + 1, mask[i] == 1])[0] for i in range(3)]
    assert together == alone


def test_a_step_from_token_ids_decodes_as_one_from_embeddings(radreport):
    """The engine's call (`step_tokens`: cached embeddings and text positions written into the bound inputs)
    gives `step`'s logits for the same tokens, rows out of physical order and a row left out included."""
    graphs, decoder = radreport
    by_ids, by_embeds = _fused(graphs, decoder), _fused(graphs, decoder)
    rng = np.random.default_rng(8)
    lengths = [5, 8, 3]
    prompts = [by_embeds.embed(rng.integers(5, 500, (1, n)), [0]) for n in lengths]
    for backend in (by_ids, by_embeds):
        for row, x in enumerate(prompts):
            backend.prefill(row, x, np.arange(x.shape[1])[None])
    for rows in ([0, 1, 2], [0, 1, 2], [2, 0, 1], [1, 2]):  # steady, permuted, then row 0 swapped out
        tokens = [int(t) for t in rng.integers(5, 500, len(rows))]
        at = [lengths[r] for r in rows]
        want = by_embeds.step(rows, by_embeds.embed(np.array(tokens)[:, None], rows), np.array(at)[:, None])
        np.testing.assert_allclose(by_ids.step_tokens(rows, tokens, at), want, rtol=0, atol=1e-6)
        for r in rows:
            lengths[r] += 1
    assert [by_ids.kv.length_of(r) for r in range(3)] == lengths


def test_greedy_runs_give_the_tokens_of_single_steps(radreport):
    """The engine's multi-step greedy runs (`decode_greedy`: several steps in one backend call) against one call
    per step: the same tokens for rows with their own caps and stop tokens, a sampled row (no runs while it
    decodes) beside them; and the runs are really taken."""
    graphs, decoder = radreport
    fused = _fused(graphs, decoder)
    rng = np.random.default_rng(9)
    pixels, ids = _rr_inputs(fused, rng, rows=4)
    runs: list[int] = []
    greedy_run = fused.decode_greedy

    def counted(*args):
        out = greedy_run(*args)
        runs.append(len(out))
        return out

    def generate_all(multi_step: bool, stop: int | None = None) -> list[list[int]]:
        engine = Engine(fused, max_batch=4, greedy_run_steps=32 if multi_step else 1)
        engine._decode_greedy = counted  # the backend's own call, counted
        caps = (30, 9, 30, 30)
        opts = [GenerationOptions(max_new_tokens=n) for n in caps]
        if stop is not None:
            opts[0] = GenerationOptions(max_new_tokens=30, stop_token_ids=[stop])
        opts[3] = GenerationOptions(max_new_tokens=12, temperature=0.8, seed=3)
        tickets = [engine.submit(Request(ids[i], opts[i], pixels[i])) for i in range(4)]
        engine.run()
        return [t.result().token_ids for t in tickets]

    alone = generate_all(False)
    stop = alone[0][14]  # row 0 stops before its 15th token
    single = generate_all(False, stop)
    assert not runs
    assert len(single[0]) == alone[0].index(stop) and len(single[1]) == 9
    assert generate_all(True, stop) == single
    assert runs and max(runs) > 1  # after the sampled row left, the greedy rows ran several steps a call


def test_the_greedy_token_output_is_numpys_argmax_ties_included(radreport, tmp_path):
    """The lowering's `greedy_token` (ArgMax in the graph, what greedy runs read) against numpy's argmax of the same
    step's logits; then with a lower token's LM-head row made equal to the winner's, a tie both must break to it."""
    graphs, decoder = radreport
    fused = _fused(graphs, decoder)
    assert fused.signature.greedy
    x = fused.embed(np.random.default_rng(13).integers(5, 500, (1, 7)), [0])
    fused.prefill(0, x, np.arange(7)[None])
    logits = fused.step_tokens([0], [9], [7]).copy()
    step = fused._steps[1]
    assert step.greedy is not None and step.greedy[0] == int(logits.argmax())
    winner = int(logits.argmax())
    model = ir.load(decoder)
    head = next(n for n in model.graph if n.outputs[0].name == names.LOGITS).inputs[1].producer()
    weight = head.inputs[0].const_value.numpy().copy()  # (vocab, hidden), transposed in the graph
    assert winner > 0
    lower = winner - 1  # a lower id: a tie must break to it
    weight[lower] = weight[winner]
    head.inputs[0].const_value = ir.tensor(weight, name=head.inputs[0].name)
    ir.save(model, tmp_path / "tied.onnx")
    tied = _fused(graphs, tmp_path / "tied.onnx")
    tied.prefill(0, x, np.arange(7)[None])
    logits = tied.step_tokens([0], [9], [7])
    assert logits[0, lower] == logits[0, winner] == logits.max()
    assert tied._steps[1].greedy[0] == int(logits.argmax()) == lower


def test_a_greedy_run_ends_at_a_stop_a_signal_or_the_context(radreport):
    graphs, decoder = radreport
    fused = _fused(graphs, decoder, capacity=8)
    x = fused.embed(np.random.default_rng(11).integers(5, 500, (1, 6)), [0])
    fused.prefill(0, x, np.arange(6)[None])
    free = fused.decode_greedy([0], [7], [6], 20, frozenset(), lambda: True)
    assert len(free) == 20 and fused.kv.length_of(0) == 26 and fused.kv.capacity == 32  # grown once, for the run
    fused.release(0)
    fused.prefill(0, x, np.arange(6)[None])
    stopped = fused.decode_greedy([0], [7], [6], 20, frozenset({free[4][0]}), lambda: True)
    assert stopped == free[: free.index(free[4]) + 1]  # ends at the step that chose the stop token
    fused.release(0)
    fused.prefill(0, x, np.arange(6)[None])
    calls = iter(range(100))
    assert fused.decode_greedy([0], [7], [6], 20, frozenset(), lambda: next(calls) < 2) == free[:3]
    fused.release(0)
    y = fused.embed(np.random.default_rng(12).integers(5, 500, (1, RR_POSITIONS - 3)), [0])
    fused.prefill(0, y, np.arange(RR_POSITIONS - 3)[None])
    assert len(fused.decode_greedy([0], [7], [RR_POSITIONS - 3], 20, frozenset(), lambda: True)) == 3
    with pytest.raises(ContextExceededError):  # the context is full: the next single step says so
        fused.step_tokens([0], [7], [RR_POSITIONS])


def test_first_prompts_prefilled_together_equal_one_row_at_a_time(radreport):
    """`prefill_rows` (several new rows' first prompts in one decoder call) against one `prefill` per row: the same
    logits and KV cache to the bit, with a decoding row already in physical row 0; and what it refuses."""
    graphs, decoder = radreport
    together, alone = _fused(graphs, decoder), _fused(graphs, decoder)
    rng = np.random.default_rng(21)
    x = together.embed(rng.integers(5, 500, (4, 9)), [0, 1, 2, 3])
    pos = np.tile(np.arange(9), (3, 1))
    for backend in (together, alone):
        backend.prefill(0, x[:1, :5], np.arange(5)[None])  # a row of another length, in physical row 0
    got = together.prefill_rows([3, 1, 2], x[1:], pos)
    want = np.stack([alone.prefill(row, x[i + 1 : i + 2], pos[:1]) for i, row in enumerate((3, 1, 2))])
    np.testing.assert_array_equal(got, want)
    for row in (0, 1, 2, 3):
        a, b = together.kv.physical(row), alone.kv.physical(row)
        assert together.kv.length_of(row) == alone.kv.length_of(row)
        for k1, k2 in zip(together.kv.keys + together.kv.values, alone.kv.keys + alone.kv.values):
            np.testing.assert_array_equal(k1[a, :, :9], k2[b, :, :9])
    with pytest.raises(ConfigError, match="same positions"):
        together.prefill_rows([4, 5], x[:2], np.stack([np.arange(9), np.arange(9) + 1]))
    with pytest.raises(ConfigError, match="new rows only"):
        together.prefill_rows([1, 5], x[:2], pos[:2])
    assert 4 not in together.kv and 5 not in together.kv  # nothing acquired by a refused call


def test_the_engine_prefills_prompts_of_one_length_together(radreport):
    """Requests waiting together whose prompts have the same length and positions share one prefill call; others
    prefill alone, and the tokens are those of one prefill per row."""
    graphs, decoder = radreport
    fused = _fused(graphs, decoder)
    rng = np.random.default_rng(22)
    pixels, ids = _rr_inputs(fused, rng, rows=5, prompt=12)
    prompts = [ids[0], ids[1], ids[2, :7], ids[3], ids[4]]  # four of 12 tokens (+ the image's), one of 7
    calls: list[int] = []
    prefill_rows = fused.prefill_rows

    def counted(rows, *args):
        calls.append(len(rows))
        return prefill_rows(rows, *args)

    def run(together: bool, chunk: int | None = None) -> list[list[int]]:
        engine = Engine(fused, max_batch=5, prefill_chunk=chunk)
        engine._prefill_rows = counted if together else None
        opts = GenerationOptions(max_new_tokens=16)
        tickets = [engine.submit(Request(prompts[i], opts, pixels[i])) for i in range(5)]
        engine.run()
        return [t.result().token_ids for t in tickets]

    alone = run(False)
    assert not calls
    assert run(True) == alone
    assert calls == [4]  # the four prompts of one length in one call; the 7-token prompt alone
    calls.clear()
    image = fused.encode_images(pixels[:1]).shape[1]
    assert run(True, chunk=2 * (image + 12)) == alone
    assert calls == [2, 2]  # within the chunk's token budget: two prompts a call


def test_prompts_grouped_while_rows_decode_stay_within_the_token_budget(radreport, monkeypatch):
    """With rows decoding, a shared prefill holds at most `PREFILL_BATCH_TOKENS` tokens (their next token waits
    for it); with none decoding, every waiting prompt of the length goes at once."""
    from edgekit.engine import scheduler

    graphs, decoder = radreport
    fused = _fused(graphs, decoder)
    rng = np.random.default_rng(23)
    pixels, ids = _rr_inputs(fused, rng, rows=7, prompt=12)
    image = fused.encode_images(pixels[:1]).shape[1]
    monkeypatch.setattr(scheduler, "PREFILL_BATCH_TOKENS", 2 * (image + 12))
    calls: list[int] = []
    prefill_rows = fused.prefill_rows

    def counted(rows, *args):
        calls.append(len(rows))
        return prefill_rows(rows, *args)

    engine = Engine(fused, max_batch=7)
    engine._prefill_rows = counted
    opts = GenerationOptions(max_new_tokens=12)
    first = [engine.submit(Request(ids[i], opts, pixels[i])) for i in range(3)]
    engine.step()  # nothing decodes yet: the three prompts in one call
    assert calls == [3]
    later = [engine.submit(Request(ids[i], opts, pixels[i])) for i in range(3, 7)]
    engine.run()
    assert calls == [3, 2, 2]  # beside the three decoding rows: two prompts a call
    assert all(len(t.result().token_ids) == 12 for t in first + later)


def test_chunked_prefill_gives_the_same_tokens(radreport):
    graphs, decoder = radreport
    fused = _fused(graphs, decoder)
    rng = np.random.default_rng(5)
    pixels, ids = _rr_inputs(fused, rng, rows=2, prompt=11)
    opts = GenerationOptions(max_new_tokens=20)

    def run(chunk):
        engine = Engine(fused, max_batch=2, prefill_chunk=chunk)
        tickets = [engine.submit(Request(ids[i], opts, pixels[i])) for i in range(2)]
        engine.run()
        return [t.result().token_ids for t in tickets]

    whole = run(None)
    assert run(7) == whole  # the 16 image tokens + 11 prompt tokens in chunks of 7: past > 0 and seq > 1
    assert whole == _tokens(_portable(graphs), pixels, ids, new=20)


def test_release_moves_the_last_row_and_keeps_the_others(radreport):
    graphs, decoder = radreport
    fused, fresh = _fused(graphs, decoder), _fused(graphs, decoder)
    rng = np.random.default_rng(6)
    prompts = [fused.embed(rng.integers(5, 500, (1, n)), [0]) for n in (6, 9, 4)]
    for row, x in enumerate(prompts):
        fused.prefill(row, x, np.arange(x.shape[1])[None])
    fused.release(0)  # physical row 0 is filled by row 2
    assert (fused.kv.physical(2), fused.kv.physical(1)) == (0, 1) and fused.kv.count == 2
    for row in (1, 2):
        x = prompts[row]
        fresh.prefill(row, x, np.arange(x.shape[1])[None])
    for i in range(3):
        x = fused.embed(np.array([[7 + i], [11 + i]]), [1, 2])
        pos = np.array([[9 + i], [4 + i]])
        np.testing.assert_allclose(fused.step([1, 2], x, pos), fresh.step([1, 2], x, pos), rtol=0, atol=1e-5)
    fused.prefill(0, prompts[0], np.arange(6)[None])  # a new request takes physical row 2
    assert fused.kv.physical(0) == 2
    x = fused.embed(np.array([[3], [5]]), [0, 1])
    got = fused.step([0, 1], x, np.array([[6], [12]]))  # not [0, n): rows swapped into place, inputs permuted
    assert sorted(fused.kv.physical(r) for r in (0, 1)) == [0, 1]
    fresh.release(2)
    fresh.prefill(0, prompts[0], np.arange(6)[None])
    np.testing.assert_allclose(got, fresh.step([0, 1], x, np.array([[6], [12]])), rtol=0, atol=1e-5)


def test_capacity_doubles_and_keeps_the_cache(radreport):
    graphs, decoder = radreport
    small = _fused(graphs, decoder, capacity=2)
    rng = np.random.default_rng(7)
    pixels, ids = _rr_inputs(small, rng, rows=2)
    tokens = _tokens(small, pixels, ids, new=30)
    # 16 image + 10 prompt positions: 2 -> 32 at the prefill; past 32 while decoding: 64 (two moves)
    assert small.kv.capacity == 64 and small.kv.generation == 2
    assert tokens == _tokens(_fused(graphs, decoder), pixels, ids, new=30)


def test_kv_buffers_compaction_moves_rows_with_their_data():
    kv = KvBuffers(layers=1, rows=4, kv_heads=1, head_dim=2, capacity=4)
    for row, length in ((10, 3), (11, 1), (12, 2), (13, 4)):
        p = kv.acquire(row)
        kv.keys[0][p, 0, :length] = row
        kv.values[0][p, 0, :length] = -row
        kv.advance(p, length)
    kv.release(11)  # 13 moves into physical row 1
    assert kv.physical(13) == 1 and kv.length_of(13) == 4 and kv.count == 3
    assert (kv.keys[0][1, 0] == 13).all() and (kv.values[0][1, 0] == -13).all()
    where = kv.gather([13, 12])  # 10 sits at 0: 12 swaps with it
    assert sorted(where) == [0, 1] and kv.physical(10) == 2
    for row in (10, 12, 13):
        p, n = kv.physical(row), kv.length_of(row)
        assert (kv.keys[0][p, 0, :n] == row).all() and (kv.values[0][p, 0, :n] == -row).all()
    kv.reserve([13], 1)  # 4 + 1 > 4: doubles
    assert kv.capacity == 8 and (kv.keys[0][kv.physical(13), 0, :4] == 13).all()


# the target ---------------------------------------------------------------------------------------------------
def test_build_ships_the_fused_decoder_and_serves_it(tmp_path):
    from edgekit.build import build
    from edgekit.bundle import load_bundle, write_bundle
    from edgekit.plugins import load_backend
    from edgekit.target import RuntimeOptions

    result = build("cpu", tmp_path / "bundle", parity=False)
    bundle = load_bundle(result.bundle)
    assert FUSED_ROLE in bundle.manifest.components and bundle.manifest.runtime == {"decoder": "fused"}
    figure = result.figures["cpu_fused_parity"]
    assert figure["max_rel"] < FLOAT_TOL and figure["greedy_agree"] == "9/9"
    backend = load_backend(bundle, RuntimeOptions(threads=1))
    assert isinstance(backend, CpuSlotBackend) and backend.max_rows == 8
    assert isinstance(load_backend(bundle, RuntimeOptions(threads=1, settings={"decoder": "portable"})), CpuBackend)
    with pytest.raises(ConfigError, match="max_rows"):
        load_backend(bundle, RuntimeOptions(settings={"max_rows": 0}))
    older = {r: bundle.component(r) for r in bundle.manifest.components if r != FUSED_ROLE}
    old = load_bundle(write_bundle(tmp_path / "old", older, name="old", target="cpu"))  # before the fused decoder
    assert isinstance(load_backend(old, RuntimeOptions(threads=1)), CpuBackend)
    with pytest.raises(ConfigError, match="no fused cpu decoder"):
        load_backend(old, RuntimeOptions(settings={"decoder": "fused"}))


def test_profiling_traces_the_fused_decoder(radreport, tmp_path):
    graphs, decoder = radreport
    fused = _fused(graphs, decoder, profile_dir=tmp_path)
    rng = np.random.default_rng(8)
    pixels, ids = _rr_inputs(fused, rng)
    generate(fused, pixels, ids, GenerationOptions(max_new_tokens=3))
    traces = fused.end_profiling()
    assert len(traces) == 3
    assert any("GroupQueryAttention" in t.read_text() for t in traces)


def test_prefill_keeps_its_bound_inputs_alive_while_other_threads_allocate(radreport):
    """ORT reads a bound input through its raw pointer when the run starts: an input array freed before then (a
    temporary made for the binding) and reused by another thread's allocation fed GroupQueryAttention a garbage
    total length (edgekitd, 43 of 200 reports at concurrency 8: 500s). Prefill under a thread that keeps
    allocating and filling small arrays gives the same logits every time."""
    import threading

    graphs, decoder = radreport
    fused = _fused(graphs, decoder, max_rows=1)
    rng = np.random.default_rng(9)
    x = fused.embed(rng.integers(5, 500, (1, 12)))
    positions = np.arange(12)[None]
    want = fused.prefill(0, x, positions).copy()
    fused.release(0)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            junk = [np.full(n, 0x3F000000, np.int32) for n in (1, 1, 2, 12, 24, 1)]
            del junk

    workers = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for _ in range(300):
            got = fused.prefill(0, x, positions)
            fused.release(0)
            np.testing.assert_array_equal(got, want)
    finally:
        stop.set()
        for w in workers:
            w.join()


def test_decode_token_embeddings_from_the_cache_equal_the_graphs(radreport, monkeypatch):
    """A decode step's token embeddings come from a cache of rows the embedding graph wrote (ids seen before, new
    ids in one call, the cache emptied when full): the same arrays as the graph gives."""
    import edgekit.targets.cpu.slots as slots

    graphs, decoder = radreport
    fused = _fused(graphs, decoder)
    portable = _portable(graphs)
    monkeypatch.setattr(slots, "EMBED_CACHE_TOKENS", 6)
    # repeats, misses, a refill, then a refill whose step mixes a cached token with new ones
    for ids in (
        [[7], [9], [7]],
        [[9], [11], [12], [13]],
        [[7], [40]],
        [[3]],
        [[60], [61], [62], [63]],
        [[3], [70], [71]],
    ):
        ids = np.asarray(ids)
        np.testing.assert_array_equal(fused.embed(ids), portable.embed(ids))
        assert len(fused._embeddings) <= 6
    assert fused.embed(np.asarray([[5, 6, 7]])).shape[1] == 3  # a prompt goes through the graph
