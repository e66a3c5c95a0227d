"""DSS head-mask policy (docs/x1/dss.md): budget, threshold, ordering, dense prefill, anti-starvation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edgekit.errors import BundleError, ConfigError
from edgekit.targets.x1.dss import HeadMaskPolicy, load_head_importance

L, H = 4, 6


def _policy(target=0.38, threshold=0.015, g=None, **kw) -> HeadMaskPolicy:
    return HeadMaskPolicy(
        np.ones((L, H)) if g is None else g, sparsity_target=target, sensitivity_threshold=threshold, **kw
    )


def _norms(small: dict[tuple[int, int], float], base: float = 1.0) -> np.ndarray:
    n = np.full((L, H), base)
    for (l, h), v in small.items():
        n[l, h] = v
    return n


def _decode_steps(p: HeadMaskPolicy, stats, steps: int) -> list[np.ndarray]:
    p.begin_prefill()
    assert p(None).all()
    masks = []
    for _ in range(steps):
        p.begin_decode()
        masks.append(p(stats))
    return masks


def test_prefill_and_first_decode_token_run_dense_even_with_tiny_heads():
    p = _policy()
    stats = _norms({(l, h): 1e-6 for l in range(L) for h in range(3)})
    p.begin_prefill()
    assert p(stats).all()  # statistics from an earlier sequence are ignored in prefill
    p.begin_decode()
    assert p(stats).all()  # first decode token: no statistics of this sequence yet
    p.begin_decode()
    assert not p(stats).all()


def test_skips_never_exceed_the_budget_and_reach_it_when_candidates_suffice():
    p = _policy(target=0.38)
    budget = math.floor(0.38 * L * H)  # 9 of 24
    # 12 heads with a share far under the threshold: the budget binds
    stats = _norms({(l, h): 1e-4 for l in range(L) for h in range(3)})
    masks = _decode_steps(p, stats, 6)
    for m in masks[1:]:
        assert (~m).sum() == budget
    assert p.stats.skip_rate == pytest.approx(5 * budget / (6 * L * H))
    assert p.report()["budget_heads_per_token"] == budget


def test_only_heads_under_the_threshold_are_skipped():
    p = _policy(target=0.38, threshold=0.015)
    # shares: a head with norm 0.01 among five of norm 1 has share 0.01/5.01 = 0.002 < 0.015; 0.1 -> 0.0196 > it
    stats = _norms({(0, 1): 0.01, (2, 4): 0.01, (3, 0): 0.1})
    m = _decode_steps(p, stats, 2)[1]
    assert set(map(tuple, np.argwhere(~m))) == {(0, 1), (2, 4)}


def test_lowest_contribution_first_with_ties_to_lower_layer_then_head():
    p = _policy(target=2 / (L * H) + 1e-9, threshold=0.5)  # budget 2, every head a candidate
    stats = _norms({(3, 5): 0.001, (1, 2): 0.01, (0, 3): 0.01})  # equal shares in layers 0 and 1
    m = _decode_steps(p, stats, 2)[1]
    assert set(map(tuple, np.argwhere(~m))) == {(3, 5), (0, 3)}


def test_importance_weights_protect_a_quiet_but_important_head():
    g = np.ones((L, H))
    g[0, 1] = 20.0  # learned important: c = 20 * share
    stats = _norms({(0, 1): 0.01, (1, 1): 0.01})
    m = _decode_steps(_policy(g=g), stats, 2)[1]
    assert m[0, 1] and not m[1, 1]


def test_a_head_skipped_for_8_tokens_is_forced_active_on_the_next():
    p = _policy(max_consecutive_skips=8)
    stats = _norms({(1, 3): 1e-5})
    masks = _decode_steps(p, stats, 12)
    skipped = [not m[1, 3] for m in masks]
    # token 1 dense, tokens 2..9 skipped (8 in a row), token 10 forced active, then skipped again
    assert skipped == [False] + [True] * 8 + [False] + [True] * 2
    assert p.stats.forced_active == 1


def test_a_skipped_head_keeps_its_last_norm():
    p = _policy(threshold=0.015)
    p.begin_prefill()
    p(None)
    p.begin_decode()
    p(_norms({(2, 2): 1e-4}))
    p.begin_decode()
    m = p(_norms({(2, 2): 1e-4}))
    assert not m[2, 2]
    # the emulator reports 0 for the head it did not compute: that must not change what the policy knows
    p.begin_decode()
    p(_norms({(2, 2): 0.0}))
    assert p._norms[2, 2] == pytest.approx(1e-4)


def test_zero_target_never_skips_and_bad_parameters_are_named():
    masks = _decode_steps(_policy(target=0.0), _norms({(0, 0): 1e-9}), 4)
    assert all(m.all() for m in masks)
    with pytest.raises(ConfigError, match="sparsity_target"):
        _policy(target=1.0)
    with pytest.raises(ConfigError, match="sensitivity_threshold"):
        _policy(threshold=-0.1)
    p = _policy()
    p.begin_decode()
    p(None)
    p.begin_decode()
    with pytest.raises(ConfigError, match="shape"):
        p(np.ones((L, H + 1)))


def test_batch_statistics_use_the_largest_row():
    p = _policy()
    a, b = _norms({(0, 0): 1e-5}), _norms({})
    m = _decode_steps(p, np.stack([a, b]), 2)[1]
    assert m.all()


def test_head_importance_file_is_normalised_per_layer(tmp_path):
    doc = {
        "layers": [{"score": [1, 1, 2, 2, 3, 3]}, {"score": [0] * 6}, {"score": [5] * 6}, {"score": [6, 0, 0, 0, 0, 0]}]
    }
    path = tmp_path / "head_importance.json"
    path.write_text(json.dumps(doc))
    g = load_head_importance(path, L, H)
    np.testing.assert_allclose(g.mean(axis=1), 1.0)
    np.testing.assert_allclose(g[0], np.array([1, 1, 2, 2, 3, 3]) / 2)
    np.testing.assert_allclose(g[1], 1.0)  # an all-zero layer has nothing to rank by
    with pytest.raises(BundleError, match="layers"):
        load_head_importance(path, L + 1, H)
    path.write_text("{not json")
    with pytest.raises(BundleError, match="unreadable"):
        load_head_importance(path, L, H)
