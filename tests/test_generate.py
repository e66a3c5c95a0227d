"""Generation over the cpu backend: greedy, seeded top-p sampling, stop tokens, limits, batches, timings."""

from __future__ import annotations

import numpy as np
import pytest

from edgekit.errors import ConfigError, EdgekitError
from edgekit.generate import GenerationOptions, generate, generate_batch, next_tokens

from small_model import SMALL


@pytest.fixture(scope="module")
def backend(small_backend):
    return small_backend


def _study(seed: int, batch: int = 1):
    rng = np.random.default_rng(seed)
    pixels = rng.uniform(-1, 1, (batch, 2, 1, 32, 32)).astype(np.float32)
    return pixels, rng.integers(5, SMALL.vocab_size, (batch, 6))


def test_greedy_follows_the_argmax_of_the_backend(backend):
    pixels, prompt = _study(0)
    result = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=8))
    x = np.concatenate([backend.encode_images(pixels), backend.embed(prompt)], axis=1)
    expected = []
    for _ in range(8):  # recompute without cache: the loop's bookkeeping (mask, positions) must agree
        n = x.shape[1]
        logits, _ = backend.decode(x, np.ones((1, n), np.int64), np.arange(n)[None], None)
        expected.append(int(logits[0, -1].argmax()))
        x = np.concatenate([x, backend.embed(np.array([[expected[-1]]]))], axis=1)
    assert result.token_ids == expected
    assert result.stop_reason == "max_new_tokens"


def test_sampling_is_reproducible_per_seed_and_differs_across_seeds(backend):
    pixels, prompt = _study(1)
    runs = {
        seed: generate(
            backend, pixels, prompt, GenerationOptions(max_new_tokens=16, temperature=1.0, seed=seed)
        ).token_ids
        for seed in range(4)
    }
    again = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=16, temperature=1.0, seed=2)).token_ids
    assert again == runs[2]
    assert len({tuple(t) for t in runs.values()}) > 1


def test_tiny_top_p_equals_greedy(backend):
    for seed in range(3):
        pixels, prompt = _study(10 + seed)
        greedy = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=12)).token_ids
        nucleus = generate(
            backend, pixels, prompt, GenerationOptions(max_new_tokens=12, temperature=1.5, top_p=1e-6, seed=seed)
        ).token_ids
        assert nucleus == greedy


def test_stop_tokens_stop_and_are_not_returned(backend):
    pixels, prompt = _study(2)
    free = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=12)).token_ids
    stop = free[4]
    cut = free.index(stop)
    never = next(i for i in range(5, SMALL.vocab_size) if i not in free)
    result = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=12, stop_token_ids=[never, stop]))
    assert result.token_ids == free[:cut]
    assert result.stop_reason == "stop_token"


def test_timings_split_encode_prefill_and_decode(backend):
    pixels, prompt = _study(3)
    t = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=10)).timings
    assert t.encode_ms > 0 and t.prefill_ms > 0 and t.decode_ms > 0
    assert t.decode_tokens_per_s == pytest.approx(9 / (t.decode_ms / 1e3))  # 9 decode calls after prefill
    one = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=1))
    assert len(one.token_ids) == 1 and one.timings.decode_tokens_per_s == 0.0


def test_batch_rows_match_single_prompt_runs(backend):
    a_pix, a_ids = _study(4)
    b_pix, b_ids = _study(5)
    b_ids = b_ids[:, :4]
    pixels = np.concatenate([a_pix, b_pix])
    ids = np.concatenate([a_ids, np.pad(b_ids, ((0, 0), (2, 0)))])  # left padding
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    opts = GenerationOptions(max_new_tokens=8)
    rows = generate_batch(backend, pixels, ids, opts, prompt_attention_mask=mask)
    assert rows[0].token_ids == generate(backend, a_pix, a_ids, opts).token_ids
    assert rows[1].token_ids == generate(backend, b_pix, b_ids[0], opts).token_ids  # 1-D prompt accepted


def test_next_tokens_nucleus_keeps_only_the_head_of_the_distribution():
    logits = np.log(np.array([[0.6, 0.3, 0.1]]))
    rng = np.random.default_rng(0)
    head = {int(next_tokens(logits, GenerationOptions(temperature=1.0, top_p=0.5), rng)[0]) for _ in range(200)}
    two = [int(next_tokens(logits, GenerationOptions(temperature=1.0, top_p=0.85), rng)[0]) for _ in range(400)]
    full = [int(next_tokens(logits, GenerationOptions(temperature=1.0), rng)[0]) for _ in range(2000)]
    assert head == {0}
    assert set(two) == {0, 1} and 0.55 < two.count(0) / 400 < 0.78  # renormalised: 0.6 / 0.9 = 0.67
    assert set(full) == {0, 1, 2} and 0.07 < full.count(2) / 2000 < 0.13
    assert list(next_tokens(np.array([[0.0, 2.0, 2.0], [5.0, 1.0, 0.0]]), GenerationOptions(), rng)) == [1, 0]


def test_bad_options_and_inputs_raise_clear_errors(backend):
    for bad in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ConfigError):
            GenerationOptions(**{"max_new_tokens": 4, **bad})
    pixels, prompt = _study(6, batch=2)
    with pytest.raises(EdgekitError, match="generate_batch"):
        generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=2))
    with pytest.raises(EdgekitError, match="pixel_values"):
        generate(backend, pixels[0], prompt[:1], GenerationOptions(max_new_tokens=2))
    opts = GenerationOptions(max_new_tokens=2)
    opts.temperature = -0.5  # options are mutable (the reporter fills stop tokens in): checked again at use
    with pytest.raises(ConfigError, match="temperature"):
        generate(backend, pixels[:1], prompt[:1], opts)
