"""radreport-tiny training: a few steps reduce the loss, reruns match bit for bit, KV-cache decoding is exact."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from edgekit.models.radreport_tiny.data import build_split, encode_split, iterate_batches, tokenizer_corpus  # noqa: E402
from edgekit.models.radreport_tiny.determinism import set_determinism, to_torch  # noqa: E402
from edgekit.models.radreport_tiny.tokenizer import train_tokenizer  # noqa: E402
from edgekit.models.radreport_tiny.train import TrainOptions, build_model, train_loop  # noqa: E402
from edgekit.models.radreport_tiny.validation import greedy_reports  # noqa: E402
from edgekit.preprocess import PreprocessConfig  # noqa: E402

TINY = dict(
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
    hidden=32,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=64,
)
STEPS = 24


@pytest.fixture(scope="module")
def enc():
    split = build_split("train", 8, PreprocessConfig())
    tok = train_tokenizer(tokenizer_corpus(split))
    out = encode_split(tok, split)
    out.vocab_size = tok.get_vocab_size()
    return out


def _train(enc, seed=0):
    opts = TrainOptions(batch_size=4, lr=1e-2, warmup_frac=0.1, seed=seed, model=TINY)
    set_determinism(opts.seed, opts.threads)
    cfg = opts.model_config(enc.vocab_size, PreprocessConfig())
    model = build_model(cfg, opts.seed)
    batches = iterate_batches(enc, batch_size=4, epochs=STEPS // 2, seed=opts.seed)
    losses = train_loop(model, batches, opts, STEPS, out=None)
    return model, losses


def test_steps_reduce_loss_and_rerun_is_bit_identical(enc):
    model_a, losses_a = _train(enc)
    assert len(losses_a) == STEPS
    assert sum(losses_a[-3:]) / 3 < 0.8 * sum(losses_a[:3]) / 3
    model_b, losses_b = _train(enc)
    assert losses_a == losses_b
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    _, losses_c = _train(enc, seed=1)
    assert losses_c != losses_a  # the seed matters, so the equality above is not vacuous


def test_greedy_kv_cache_matches_full_recompute(enc):
    set_determinism(0, 2)
    opts = TrainOptions(model=TINY)
    model = build_model(opts.model_config(enc.vocab_size, PreprocessConfig()), 0).eval()
    pv = torch.from_numpy(enc.data.pixels[:3].astype("float32"))
    prompts = [enc.prompts[i][enc.data.texts[i].modality] for i in range(3)]
    batched = greedy_reports(model, pv.numpy(), prompts, max_new_tokens=6)  # the core's engine, rows together
    for i in range(3):
        ids = list(prompts[i])
        with torch.no_grad():
            for _ in range(len(batched[i])):
                logits = model(pv[i : i + 1], torch.tensor([ids]))
                ids.append(int(logits[0, -1].argmax()))
        assert ids[len(prompts[i]) :] == batched[i]


def test_model_options_are_checked():
    from edgekit.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown model option"):
        replace(TrainOptions(), model={"hiddne": 3}).model_config(100, PreprocessConfig())


def test_count_map_loss_is_the_squared_count_error_per_cell_and_leaves_the_lm_loss_alone(enc):
    from edgekit.models.radreport_tiny.data import COUNT_CHANNELS, make_batch
    from edgekit.models.radreport_tiny.objectives import CountMapProbe, training_loss

    set_determinism(0, 2)
    cfg = TrainOptions(model=TINY).model_config(enc.vocab_size, PreprocessConfig())
    model, probe = build_model(cfg, 0), CountMapProbe(cfg, len(COUNT_CHANNELS))
    cells = cfg.grid // cfg.pool_stride
    batch = to_torch(make_batch(enc, [(i, enc.data.texts[i].modality, 0) for i in range(4)], count_cells=cells))
    assert batch["count_maps"].shape == (4, len(COUNT_CHANNELS), cells * cells)
    with torch.no_grad():
        plain, lm = training_loss(model, None, batch, 0.0)
        total, lm_too = training_loss(model, None, batch, 0.0, probe, 1.0)
        err = probe(model.encode_images(batch["pixel_values"])) - batch["count_maps"]
        batch["count_maps"] = batch["count_maps"] + 1.0  # one more nodule of each side in every cell
        more, _ = training_loss(model, None, batch, 0.0, probe, 0.5)
    assert plain == lm == lm_too
    assert torch.allclose(total - lm, err.pow(2).sum((1, 2)).mean(), rtol=1e-5)
    assert torch.allclose(more - lm, 0.5 * (err - 1.0).pow(2).sum((1, 2)).mean(), rtol=1e-5)


def test_head_gates_close_the_lowest_heads_on_schedule_and_fold_into_o_proj_exactly(enc):
    from edgekit.models.radreport_tiny.data import make_batch
    from edgekit.models.radreport_tiny.head_gates import HeadGates, closed_target

    assert [closed_target(s, 100, 24, 0.375, 0.4, 0.6) for s in (0, 38, 49, 59, 99)] == [0, 0, 4, 9, 9]
    set_determinism(0, 2)
    cfg = TrainOptions(model=TINY).model_config(enc.vocab_size, PreprocessConfig())
    model = build_model(cfg, 0).eval()
    gates = HeadGates(cfg.layers, cfg.heads)
    with torch.no_grad():
        gates.logits.copy_(torch.tensor([[3.0, -1.0, 2.0, -2.0], [-3.0, 1.0, 0.5, 2.5]]))
    assert gates.close_to(3, min_open_per_layer=1) == [(1, 0), (0, 3), (0, 1)]  # lowest first, globally
    assert gates.close_to(7, min_open_per_layer=1) == [(1, 2), (1, 1), (0, 2)]  # 6, not 7: each layer keeps one
    assert gates.values()[gates.closed].eq(0).all() and gates.closed.sum() == 6
    b = to_torch(make_batch(enc, [(i, enc.data.texts[i].modality, 0) for i in range(2)]))
    with torch.no_grad():
        plain = model(b["pixel_values"], b["input_ids"], b["attention_mask"])
        with gates.applied(model):
            gated = model(b["pixel_values"], b["input_ids"], b["attention_mask"])
        assert all(layer.self_attn.head_gate is None for layer in model.model.layers)  # reset after the block
        doc = gates.importance_doc(model)
        gates.fold_into(model)
        folded = model(b["pixel_values"], b["input_ids"], b["attention_mask"])
    assert (gated - plain).abs().max() > 1e-3
    torch.testing.assert_close(folded, gated, rtol=1e-5, atol=1e-5)
    hd = cfg.head_dim
    assert model.model.layers[0].self_attn.o_proj.weight[:, 3 * hd : 4 * hd].eq(0).all()
    assert doc["layers"][0]["score"][3] == 0.0 and doc["layers"][1]["closed"] == [0, 1, 2]
    assert doc["layers"][0]["score"][0] == pytest.approx(torch.sigmoid(torch.tensor(3.0)).item())


def test_cli_flags_set_the_options_they_name(monkeypatch, tmp_path):
    """`python -m edgekit.models.radreport_tiny.train`: every flag keeps its meaning (the typer command only maps
    flags onto TrainOptions and calls `run`)."""
    from typer.testing import CliRunner

    from edgekit.errors import ConfigError
    from edgekit.models.radreport_tiny import train

    calls = []
    monkeypatch.setattr(train, "run", lambda opts, out, **kw: calls.append((opts, out, kw)))
    runner = CliRunner()
    result = runner.invoke(train.app, ["--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert calls.pop() == (TrainOptions(), tmp_path, {"evaluate": True, "cache": True})
    flags = [
        *("--out", str(tmp_path), "--train-studies", "40", "--val-studies", "6", "--epochs", "3"),
        *("--batch-size", "5", "--lr", "0.01", "--seed", "3", "--workers", "1", "--eval-studies", "4"),
        *("--phrasings", "2", "--aux-weight", "1.5", "--presence-probe-only", "--count-map-weight", "0.5"),
        *("--head-gate-rate", "0.25", "--head-gate-weight", "0.1", "--model", '{"hidden": 64}'),
        *("--no-eval", "--no-cache"),
    ]
    result = runner.invoke(train.app, flags)
    assert result.exit_code == 0, result.output
    expected = TrainOptions(
        train_studies=40,
        val_studies=6,
        epochs=3,
        batch_size=5,
        lr=0.01,
        seed=3,
        workers=1,
        eval_studies=4,
        phrasings=2,
        aux_weight=1.5,
        probe_attributes=False,
        count_map_weight=0.5,
        head_gate_rate=0.25,
        head_gate_weight=0.1,
        model={"hidden": 64},
    )
    assert calls.pop() == (expected, tmp_path, {"evaluate": False, "cache": False})
    for bad in (["--epochs", "0"], ["--batch-size", "64", "--train-studies", "32"], ["--model", "{hidden"]):
        result = runner.invoke(train.app, ["--out", str(tmp_path), *bad])
        assert result.exit_code == 2 and not calls, (bad, result.output)

    def refuse(opts, out, **kw):
        raise ConfigError("unknown model option: hiddne")

    monkeypatch.setattr(train, "run", refuse)
    result = runner.invoke(train.app, ["--out", str(tmp_path), "--model", '{"hiddne": 3}'])
    assert result.exit_code == 2 and "error: unknown model option" in result.output
