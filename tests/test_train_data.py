"""The radreport-tiny data pipeline: inference's pixel path, determinism, and loss only on the report."""

from __future__ import annotations

import numpy as np
import pytest

from edgekit.ingest.pixels import to_display
from edgekit.models.radreport_tiny.data import (
    IGNORE,
    VIDEO_MODALITY,
    build_split,
    encode_split,
    epoch_items,
    iterate_batches,
    make_batch,
    tokenizer_corpus,
)
from edgekit.models.radreport_tiny.tokenizer import BOS_ID, EOS_ID, PAD_ID, SEP_ID, train_tokenizer
from edgekit.models.synth import generate_study
from edgekit.preprocess import PreprocessConfig, preprocess_frames

N = 10


@pytest.fixture(scope="module")
def split():
    return build_split("train", N, PreprocessConfig())


@pytest.fixture(scope="module")
def enc(split):
    return encode_split(train_tokenizer(tokenizer_corpus(split)), split)


def test_pixels_are_what_inference_sees(split):
    cfg = PreprocessConfig()
    assert split.pixels.shape == (N, cfg.num_frames, 1, cfg.image_size, cfg.image_size)
    for i in (0, N - 1):
        s = generate_study(i, "train")
        want = preprocess_frames(
            to_display(
                s.stored,
                slope=s.slope,
                intercept=s.intercept,
                center=s.center,
                width=s.width,
                photometric=s.photometric,
            ),
            cfg,
        )
        np.testing.assert_array_equal(split.pixels[i], want.astype(np.float16))
        assert split.texts[i].references == tuple(s.references)


def test_build_is_deterministic_and_cache_is_transparent(split, tmp_path):
    fresh = build_split("train", N, PreprocessConfig(), cache_dir=tmp_path)
    assert fresh.digest() == split.digest()
    assert any(tmp_path.rglob("pixels.npy"))
    cached = build_split("train", N, PreprocessConfig(), cache_dir=tmp_path)
    assert cached.digest() == split.digest()
    assert build_split("val", 3, PreprocessConfig()).digest() != build_split("train", 3, PreprocessConfig()).digest()


def test_batch_masks_prompt_and_padding_out_of_the_loss(enc):
    items = [(i, enc.data.texts[i].modality, 0) for i in range(4)]
    b = make_batch(enc, items)
    ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
    assert b["pixel_values"].dtype == np.float32 and b["pixel_values"].shape[0] == 4
    for row, (i, modality, r) in enumerate(items):
        prompt, report = enc.prompts[i][modality], enc.references[i][r]
        n = len(prompt) + len(report)
        assert ids[row, 0] == BOS_ID and ids[row, len(prompt) - 1] == SEP_ID and ids[row, n - 1] == EOS_ID
        assert mask[row, :n].all() and not mask[row, n:].any()  # right padding
        assert (ids[row, n:] == PAD_ID).all()
        assert (labels[row, : len(prompt)] == IGNORE).all()  # no loss on <bos>, modality, indication, <sep>
        assert (labels[row, n:] == IGNORE).all()
        np.testing.assert_array_equal(labels[row, len(prompt) : n], report)  # the report and its <eos>


def test_epochs_are_seeded_and_vary(enc):
    a, b = epoch_items(enc, 0, 0, 0.3), epoch_items(enc, 0, 0, 0.3)
    assert a == b
    assert epoch_items(enc, 0, 1, 0.3) != a and epoch_items(enc, 1, 0, 0.3) != a
    assert sorted(i for i, _, _ in a) == list(range(N))  # each study once per epoch
    first = [x["input_ids"] for x in iterate_batches(enc, batch_size=4, epochs=2, seed=0)]
    again = [x["input_ids"] for x in iterate_batches(enc, batch_size=4, epochs=2, seed=0)]
    assert len(first) == 2 * (N // 4)
    assert all(np.array_equal(x, y) for x, y in zip(first, again))


def test_xc_modality_only_for_cine_studies(enc):
    seen = set()
    for epoch in range(40):
        for i, modality, _ in epoch_items(enc, 0, epoch, 0.3):
            t = enc.data.texts[i]
            if modality == VIDEO_MODALITY:
                assert t.is_cine and t.modality == "US"
            seen.add((t.is_cine, modality == VIDEO_MODALITY))
    if any(t.is_cine for t in enc.data.texts):
        assert (True, True) in seen and (True, False) in seen
    assert all(modality != VIDEO_MODALITY for _, modality, _ in epoch_items(enc, 0, 0, 0.0))


def test_count_maps_put_each_nodule_in_the_image_token_cell_and_side_channel_it_is_drawn_in(enc):
    from edgekit.models.radreport_tiny.data import COUNT_CHANNELS

    assert COUNT_CHANNELS == (("nodule", "left"), ("nodule", "right"))
    b = make_batch(enc, [(i, enc.data.texts[i].modality, 0) for i in range(N)], count_cells=4)
    assert b["count_maps"].shape == (N, 2, 16)
    assert "count_maps" not in make_batch(enc, [(0, enc.data.texts[0].modality, 0)])
    with_nodules = 0
    for i, t in enumerate(enc.data.texts):
        nodule = next((f for f in t.findings if f.type == "nodule"), None)
        assert b["count_maps"][i].sum() == (nodule.count if nodule else 0)
        if nodule is None:
            continue
        with_nodules += 1
        channel = COUNT_CHANNELS.index(("nodule", nodule.location))
        assert b["count_maps"][i, channel].sum() == nodule.count
        s = generate_study(i, "train")
        rows, cols = s.stored.shape[1:]
        for y, x in s.centres["nodule"]:  # the 4x4 cell of a 128-px CT is 32 px: row-major like the tokens
            assert b["count_maps"][i, channel, int(y // (rows / 4)) * 4 + int(x // (cols / 4))] >= 1
        cells = np.nonzero(b["count_maps"][i, channel])[0] % 4
        assert (cells >= 2).all() if nodule.location == "left" else (cells < 2).all()  # patient's left: image right
    assert with_nodules >= 1


def test_phrasings_limit_the_references_trained_on_without_changing_the_other_draws(enc):
    every = epoch_items(enc, 0, 3, 0.3)
    assert epoch_items(enc, 0, 3, 0.3, phrasings=4) == every
    assert len({r for _, _, r in every}) > 1  # by default, a random one of the four phrasings
    canonical = epoch_items(enc, 0, 3, 0.3, phrasings=1)
    assert [r for _, _, r in canonical] == [0] * N
    assert [(i, m) for i, m, _ in canonical] == [(i, m) for i, m, _ in every]
    two = epoch_items(enc, 0, 3, 0.3, phrasings=2)
    assert {r for _, _, r in two} <= {0, 1}
    batches = list(iterate_batches(enc, batch_size=4, epochs=1, seed=0, phrasings=1))
    first = epoch_items(enc, 0, 0, 0.3, phrasings=1)[:4]
    np.testing.assert_array_equal(batches[0]["input_ids"], make_batch(enc, first)["input_ids"])
