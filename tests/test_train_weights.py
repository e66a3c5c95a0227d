"""The committed radreport-tiny artefacts are complete, consistent with each other, small, and load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import edgekit.models.radreport_tiny as pkg
from edgekit.export.model_config import ModelConfig
from edgekit.models.radreport_tiny.tokenizer import SPECIAL_TOKENS, load_tokenizer
from edgekit.preprocess import PreprocessConfig

WEIGHTS = Path(pkg.__file__).parent / "weights"
FILES = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "generation_config.json",
    "preprocessor_config.json",
    "training_log.json",
)


def test_artefacts_present_and_small():
    missing = [f for f in FILES if not (WEIGHTS / f).is_file()]
    assert not missing, f"missing committed artefacts: {missing}"
    assert sum((WEIGHTS / f).stat().st_size for f in FILES) < 40 * 2**20


def test_configs_agree():
    cfg = ModelConfig.load(WEIGHTS / "config.json")
    tok = load_tokenizer(WEIGHTS / "tokenizer.json")
    assert tok.get_vocab_size() == cfg.vocab_size <= 1024
    pre = PreprocessConfig.load(WEIGHTS)
    assert (pre.image_size, pre.num_frames) == (cfg.image_size, cfg.num_frames)
    gen = json.loads((WEIGHTS / "generation_config.json").read_text())
    assert gen["prompt_template"] == "{modality}: {prompt}"
    ids = {k: gen[f"{k[1:-1]}_token_id"] for k in SPECIAL_TOKENS if k != "<unk>"}
    assert ids == {k: tok.token_to_id(k) for k in ids}
    log = json.loads((WEIGHTS / "training_log.json").read_text())
    assert num_image_tokens_plus_text(cfg, gen) <= cfg.max_positions
    assert log["vocab_size"] == cfg.vocab_size and log["steps"] > 0


def num_image_tokens_plus_text(cfg: ModelConfig, gen: dict) -> int:
    return cfg.num_image_tokens + 48 + gen["max_new_tokens"]  # 48: a generous prompt


def test_weights_load_into_reference_model():
    torch = pytest.importorskip("torch", reason="torch (the train extra) is needed to load the PyTorch model")
    from safetensors.torch import load_file

    from edgekit.models.radreport_tiny.modeling import RadReportTiny

    cfg = ModelConfig.load(WEIGHTS / "config.json")
    model = RadReportTiny(cfg)
    state = load_file(str(WEIGHTS / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in state.values())
    model.load_state_dict(state, strict=True)
    model.eval()
    tok = load_tokenizer(WEIGHTS / "tokenizer.json")
    ids = torch.tensor([[1, *tok.encode("CT: cough", add_special_tokens=False).ids, 3]])
    pv = torch.zeros(1, cfg.num_frames, 1, cfg.image_size, cfg.image_size)
    with torch.no_grad():
        logits = model(pv, ids)
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert np.isfinite(logits.numpy()).all()
