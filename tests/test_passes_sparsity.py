"""Sparsity passes on exported graphs: magnitude pruning, 2:4, and head importance + head pruning."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from edgekit.errors import ConfigError
from edgekit.export import export_model, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.names import DECODER
from edgekit.passes.base import PassContext, PassPreconditionError
from edgekit.passes.check import run_all, session
from edgekit.passes.heads import (
    HeadPrunePass,
    attention_layers,
    default_calibration,
    head_importance,
    heads_to_prune,
)
from edgekit.passes.patterns import find_weight_matmuls
from edgekit.passes.registry import get_pass_class
from edgekit.passes.sparsity import (
    PrunePass,
    Sparse24Pass,
    global_magnitude_masks,
    is_2to4,
    magnitude_mask,
    mask_2to4,
)

SMALL = ModelConfig(
    image_size=16,
    patch_size=8,
    num_frames=2,
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
    vocab_size=64,
    hidden=48,
    layers=3,
    heads=6,
    kv_heads=2,
    intermediate=96,
)
DEAD = (1, 4)  # (layer, head) whose o_proj columns are zeroed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    w = random_weights(SMALL, seed=3)
    layer, head = DEAD
    hd = SMALL.head_dim
    w[f"model.layers.{layer}.self_attn.o_proj.weight"][:, head * hd : (head + 1) * hd] = 0.0
    d = tmp_path_factory.mktemp("small")
    export_model(w, SMALL, d)
    return d


def load(model_dir) -> ir.Model:
    return ir.load(model_dir / DECODER)


def feeds(model, n=3, seq=10, seed=0):
    from edgekit.passes.heads import decoder_feeds

    rng = np.random.default_rng(seed)
    return [decoder_feeds(rng.standard_normal((1, seq, SMALL.hidden)).astype(np.float32), model) for _ in range(n)]


def weights_by_module(model) -> dict[str, np.ndarray]:
    return {mm.name: mm.kn() for mm in find_weight_matmuls(model)}


# ---- numerics ------------------------------------------------------------------------------------------------
def test_magnitude_mask_zeroes_exactly_the_smallest():
    w = np.array([[0.5, -0.1, 0.3], [-0.9, 0.2, 0.05]], np.float32)
    keep = magnitude_mask(w, 3)
    assert keep.tolist() == [[True, False, True], [True, False, False]]
    assert magnitude_mask(w, 0).all()


def test_global_masks_share_one_threshold():
    a, b = np.full((4, 4), 0.1, np.float32), np.full((4, 4), 1.0, np.float32)
    ka, kb = global_magnitude_masks([a, b], 0.5)
    assert not ka.any() and kb.all()  # the small layer takes the whole budget


def test_2to4_keeps_the_two_largest_of_every_group_along_k():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 5)).astype(np.float32)
    keep = mask_2to4(w)
    assert (keep.reshape(4, 4, 5).sum(axis=1) == 2).all()
    groups = np.abs(w).reshape(4, 4, 5)
    kept_min = np.where(keep.reshape(4, 4, 5), groups, np.inf).min(axis=1)
    dropped_max = np.where(keep.reshape(4, 4, 5), -np.inf, groups).max(axis=1)
    assert (kept_min >= dropped_max).all()
    assert is_2to4(np.where(keep, w, 0)) and not is_2to4(w)
    with pytest.raises(ValueError):
        mask_2to4(w[:6])


# ---- passes on the graph -------------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_prune_reaches_target_and_runs_in_ort(model_dir, scope):
    model = load(model_dir)
    f = feeds(model)
    before = run_all(session(ir.to_proto(model).SerializeToString()), f)
    report = PrunePass(ratio=0.6, scope=scope)(model).report
    per_layer = report.notes["sparsity_per_layer"]
    assert "lm_head" not in per_layer and len(per_layer) == 7 * SMALL.layers
    after_w = weights_by_module(model)
    assert (after_w["lm_head"] != 0).all()
    for name, reached in per_layer.items():
        assert reached == pytest.approx(float((after_w[name] == 0).mean()), abs=1e-6)
        if scope == "layer":
            assert abs(reached - 0.6) <= 1 / after_w[name].size + 1e-9
    assert report.notes["sparsity_overall"] == pytest.approx(0.6, abs=1e-3)
    if scope == "global":
        assert max(per_layer.values()) - min(per_layer.values()) > 0.01  # layers differ under one threshold
    after = run_all(session(model), f)
    assert np.isfinite(after[0]["logits"]).all()
    assert np.abs(after[0]["logits"] - before[0]["logits"]).max() > 1e-3


def test_sparse24_is_exactly_two_of_four_along_k_and_runs(model_dir):
    model = load(model_dir)
    original = weights_by_module(model)
    report = Sparse24Pass()(model).report
    for mm in find_weight_matmuls(model):
        w = mm.kn()
        nonzero_before = (original[mm.name].reshape(-1, 4, w.shape[1]) != 0).sum(axis=1)
        if mm.name == "lm_head":
            assert (w != 0).all()
            continue
        assert is_2to4(w), mm.name
        # exactly 2 of every 4 (fewer only where the group had fewer non-zeros: the dead head's o_proj columns)
        assert ((w.reshape(-1, 4, w.shape[1]) != 0).sum(axis=1) == np.minimum(nonzero_before, 2)).all()
        # the stored (out, in) initializer groups along its second axis: the input dimension
        stored = mm.weight.const_value.numpy()
        assert ((stored.reshape(stored.shape[0], -1, 4) != 0).sum(axis=2) <= 2).all()
        expected = 1 - np.minimum(nonzero_before, 2).sum() / w.size
        assert report.notes["sparsity_per_layer"][mm.name] == pytest.approx(expected, abs=1e-6)
        if mm.name != f"model.layers.{DEAD[0]}.self_attn.o_proj":
            assert report.notes["sparsity_per_layer"][mm.name] == 0.5
    assert np.isfinite(run_all(session(model), feeds(model, n=1))[0]["logits"]).all()


def test_sparse24_refuses_k_not_multiple_of_4(tmp_path):
    odd = ModelConfig(
        image_size=16,
        patch_size=8,
        num_frames=2,
        vision_hidden=32,
        vision_layers=1,
        vision_heads=2,
        vision_mlp=64,
        vocab_size=64,
        hidden=36,
        layers=1,
        heads=6,
        kv_heads=2,
        intermediate=90,
    )
    export_model(random_weights(odd, 0), odd, tmp_path, check=False)
    with pytest.raises(PassPreconditionError, match="down_proj"):
        Sparse24Pass()(ir.load(tmp_path / DECODER))
    Sparse24Pass(exclude=["lm_head", "*down_proj"])(ir.load(tmp_path / DECODER))  # excluded: fine


def test_config_errors_and_registry():
    with pytest.raises(ConfigError, match=r"prune\.ratio"):
        PrunePass.from_string("ratio=1.5")
    with pytest.raises(ConfigError, match=r"prune\.scope"):
        PrunePass.from_string("scope=row")
    assert get_pass_class("prune") is PrunePass and get_pass_class("sparse24") is Sparse24Pass
    assert get_pass_class("heads") is HeadPrunePass


def test_include_matching_nothing_is_refused(model_dir):
    with pytest.raises(PassPreconditionError, match="no weight matches"):
        PrunePass(include=["nothing*"])(load(model_dir))


# ---- heads ---------------------------------------------------------------------------------------------------
def test_head_layout_read_from_graph(model_dir):
    layers = attention_layers(load(model_dir))
    assert [(L.heads, L.head_dim) for L in layers] == [(SMALL.heads, SMALL.head_dim)] * SMALL.layers


def test_head_importance_is_deterministic_and_dead_head_ranks_lowest(model_dir):
    model = load(model_dir)
    f = default_calibration(model, model_dir, samples=3, seq=12)
    doc = head_importance(model, f)
    again = head_importance(load(model_dir), default_calibration(load(model_dir), model_dir, samples=3, seq=12))
    assert json.dumps(doc) == json.dumps(again)
    assert doc["calibration_tokens"] == 36
    layer, head = DEAD
    assert doc["layers"][layer]["score"][head] == 0.0
    assert doc["layers"][layer]["o_proj_norm"][head] == 0.0
    assert doc["layers"][layer]["activation_norm"][head] > 0  # the head computes; its output goes nowhere
    shares = [(s, li, h) for li, L in enumerate(doc["layers"]) for h, s in enumerate(L["share"])]
    assert min(shares)[1:] == DEAD
    assert all(s > 0 for s, li, h in shares if (li, h) != DEAD)
    for L in doc["layers"]:
        assert sum(L["share"]) == pytest.approx(1.0)
    assert heads_to_prune(doc, 1 / 18)[0] == DEAD


def test_heads_to_prune_respects_budget_and_floor():
    doc = {"layers": [{"heads": 3, "share": [0.01, 0.02, 0.97]}, {"heads": 3, "share": [0.3, 0.3, 0.4]}]}
    assert heads_to_prune(doc, 0.5) == [(0, 0), (0, 1), (1, 0)]
    assert heads_to_prune(doc, 0.5, min_heads_per_layer=2) == [(0, 0), (1, 0)]
    assert heads_to_prune(doc, 0.0) == []


def test_head_pruning_zeroes_q_rows_and_o_columns_keeps_shapes_and_writes_scores(model_dir, tmp_path):
    model = load(model_dir)
    shapes = {k: tuple(v.shape) for k, v in model.graph.initializers.items()}
    f = feeds(model)
    before = run_all(session(ir.to_proto(model).SerializeToString()), f)
    out = tmp_path / "head_importance.json"
    ctx = PassContext(graph=DECODER, model_dir=model_dir)
    report = HeadPrunePass(ratio=0.38, scores_out=str(out))(model, ctx).report
    assert report.notes["heads_pruned"] == round(0.38 * SMALL.layers * SMALL.heads) == 7
    assert {k: tuple(v.shape) for k, v in model.graph.initializers.items()} == shapes
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and len(doc["layers"]) == SMALL.layers
    assert DEAD[1] in doc["layers"][DEAD[0]]["pruned"]
    hd = SMALL.head_dim
    for L, entry in zip(attention_layers(model), doc["layers"]):
        q, o = L.q.kn(), L.o.kn()
        for h in range(SMALL.heads):
            sl = slice(h * hd, (h + 1) * hd)
            dead = h in entry["pruned"]
            assert (q[:, sl] == 0).all() == dead and (o[sl] == 0).all() == (dead or (entry["layer"], h) == DEAD)
        stats = report.notes["sparsity_per_layer"][L.prefix]
        assert stats["heads_pruned"] == len(entry["pruned"])
        assert stats["q_proj"] == pytest.approx(len(entry["pruned"]) / SMALL.heads, abs=1e-6)
    after = run_all(session(model), f)
    for name in before[0]:
        assert after[0][name].shape == before[0][name].shape  # KV cache layout unchanged
    assert np.isfinite(after[0]["logits"]).all()


def test_pruning_only_the_dead_head_changes_nothing(model_dir):
    model = load(model_dir)
    f = feeds(model)
    before = run_all(session(ir.to_proto(model).SerializeToString()), f)
    HeadPrunePass(ratio=1 / 18)(model, PassContext(model_dir=model_dir))
    after = run_all(session(model), f)
    np.testing.assert_allclose(after[0]["logits"], before[0]["logits"], atol=1e-5, rtol=0)
