"""Co-pruning by joint sensitivity: the block numerics, and the pass on an exported graph with a scores file."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from safetensors.numpy import save_file

from edgekit.export import export_model, random_weights
from edgekit.names import DECODER
from edgekit.passes.base import PassPreconditionError
from edgekit.passes.check import run_all, session
from edgekit.passes.copruning import CoPrunePass, block_keep_masks, block_scores, expand_blocks
from edgekit.passes.heads import decoder_feeds
from edgekit.passes.patterns import find_weight_matmuls
from edgekit.passes.registry import get_pass_class

from small_model import SMALL


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    export_model(random_weights(SMALL, seed=5), SMALL, d)
    return d


def weights(model) -> dict[str, np.ndarray]:
    return {mm.name: mm.kn() for mm in find_weight_matmuls(model)}


def test_block_scores_average_each_tile_and_partial_edges():
    s = np.arange(30, dtype=np.float64).reshape(5, 6)
    b = block_scores(s, 4)
    assert b.shape == (2, 2)
    assert b[0, 0] == pytest.approx(s[:4, :4].mean()) and b[1, 1] == pytest.approx(s[4:, 4:].mean())


def test_global_cut_takes_the_lowest_blocks_but_every_layer_keeps_its_floor():
    low, high = np.full((4, 4), 0.1), np.arange(16, dtype=np.float64).reshape(4, 4) + 1
    m_low, m_high = block_keep_masks([low, high], tau=0.5, min_keep=0.0)
    assert not m_low.any() and m_high.all()  # one threshold: the weak layer takes the whole cut
    m_low, m_high = block_keep_masks([low, high], tau=0.5, min_keep=0.25)
    assert m_low.sum() == 4 and m_high.all()  # ... unless it must keep a quarter of its blocks
    assert expand_blocks(np.array([[True, False]]), 4, (3, 7)).tolist() == [[True] * 4 + [False] * 3] * 3


def _scores_file(path, model, grad_for):
    arrays = {}
    for name, w in weights(model).items():
        arrays[name + ".grad_abs"] = np.ascontiguousarray(grad_for(name, w), dtype=np.float32)
        arrays[name + ".act_abs"] = np.ones(w.shape[0], np.float32)
    save_file(arrays, str(path), metadata={"edgekit": json.dumps({"step": "test", "studies": 3})})
    return path


def test_gradient_scores_decide_which_blocks_go_and_the_graph_still_runs(model_dir, tmp_path):
    model = ir.load(model_dir / DECODER)
    original = weights(model)

    # gradients that single out the first block row of every weight as unimportant, whatever its magnitude
    def grad(name, w):
        g = np.ones_like(w)
        g[:4] = 1e-6
        return g

    scores = _scores_file(tmp_path / "s.safetensors", model, grad)
    rng = np.random.default_rng(0)
    feeds = [decoder_feeds(rng.standard_normal((1, 6, SMALL.hidden)).astype(np.float32), model)]
    before = run_all(session(ir.to_proto(model).SerializeToString()), feeds)
    report = get_pass_class("copruning")(tau=0.05, scores=str(scores), min_keep=0.0)(model).report
    after_w = weights(model)
    assert np.array_equal(after_w["lm_head"], original["lm_head"])  # excluded by default
    zero_blocks = 0
    for name, w in after_w.items():
        zero_blocks += int((block_scores((w == 0).astype(float), 4) == 1).sum())
        assert (w[4:] == original[name][4:]).all()  # only blocks of the low-gradient rows went
    total_blocks = sum(block_scores(w, 4).size for n, w in after_w.items() if n != "lm_head")
    assert zero_blocks == round(0.05 * total_blocks)
    assert report.notes["score"] == "gradient" and report.notes["scores_step"]["step"] == "test"
    assert len(report.notes["scores_sha256"]) == 64
    after = run_all(session(model), feeds)
    assert np.isfinite(after[0]["logits"]).all() and np.abs(after[0]["logits"] - before[0]["logits"]).max() > 0


def test_magnitude_needs_no_file_and_gradient_without_one_is_refused_up_front(model_dir, tmp_path):
    model = ir.load(model_dir / DECODER)
    report = CoPrunePass(tau=0.2, score="magnitude")(model).report
    assert report.notes["sparsity_overall"] == pytest.approx(0.2, abs=0.03)
    with pytest.raises(PassPreconditionError, match="needs a scores file"):
        CoPrunePass(tau=0.2)(ir.load(model_dir / DECODER))
    with pytest.raises(PassPreconditionError, match="not found"):
        CoPrunePass(tau=0.2, scores=str(tmp_path / "absent.safetensors"))(ir.load(model_dir / DECODER))
    bad = _scores_file(tmp_path / "bad.safetensors", model, lambda n, w: np.ones((w.shape[0] + 1, w.shape[1])))
    with pytest.raises(PassPreconditionError, match="do not match"):
        CoPrunePass(tau=0.2, scores=str(bad))(ir.load(model_dir / DECODER))
