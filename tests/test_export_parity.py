"""ONNX (on ONNX Runtime) vs the PyTorch reference, for a small and the default radreport-tiny config."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgekit.export import export_model  # noqa: E402
from edgekit.export.model_config import ModelConfig  # noqa: E402
from edgekit.export.parity import TorchBackend, measure_export_parity  # noqa: E402
from edgekit.models.radreport_tiny.modeling import RadReportTiny  # noqa: E402
from edgekit.targets.cpu import CpuBackend  # noqa: E402

from small_model import SMALL  # noqa: E402

CONFIGS = {"small": SMALL, "default": ModelConfig()}


@pytest.fixture(scope="module", params=list(CONFIGS))
def export(request, tmp_path_factory):
    config = CONFIGS[request.param]
    torch.manual_seed(0)
    weights = {k: v.detach().numpy().copy() for k, v in RadReportTiny(config).state_dict().items()}
    out = tmp_path_factory.mktemp(request.param)
    export_model(weights, config, out)
    return config, weights, out


def test_parity_figures_over_random_inputs(export):
    config, weights, out = export
    report = measure_export_parity(out, weights, config, samples=10, decode_steps=20, seed=0)
    assert report.image_features_max_abs <= 1e-4
    assert report.prefill_logits_max_abs <= 1e-4
    assert report.decode_logits_max_abs <= 1e-4  # 20 KV-cache steps against torch's decode with past
    assert report.greedy_match_rate == 1.0 and report.greedy_token_match_rate == 1.0
    assert report.to_dict()["samples"] == 10


def test_padded_batch_prefill_and_cache_match_torch(export):
    """Left padding and a mixed batch exercise the attention-mask path that single prompts never reach."""
    config, weights, out = export
    ref, ort_backend = TorchBackend(weights, config), CpuBackend.from_dir(out)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, config.hidden)).astype(np.float32)
    mask = np.ones((2, 9), np.int64)
    mask[1, :4] = 0
    pos = np.maximum(mask.cumsum(-1) - 1, 0)
    ref_logits, ref_past = ref.decode(x, mask, pos, None)
    ort_logits, ort_past = ort_backend.decode(x, mask, pos, None)
    np.testing.assert_allclose(ort_logits, ref_logits, atol=1e-4, rtol=0)
    for (rk, rv), (ok, ov) in zip(ref_past, ort_past):
        np.testing.assert_allclose(ok, rk, atol=1e-4, rtol=0)
        np.testing.assert_allclose(ov, rv, atol=1e-4, rtol=0)
    step = rng.standard_normal((2, 1, config.hidden)).astype(np.float32)
    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    np.testing.assert_allclose(
        ort_backend.decode(step, mask2, pos[:, -1:] + 1, ort_past)[0],
        ref.decode(step, mask2, pos[:, -1:] + 1, ref_past)[0],
        atol=1e-4,
        rtol=0,
    )


def test_parity_detects_a_wrong_weight(export):
    """The figures must move when the graph and the reference disagree, or they certify nothing."""
    config, weights, out = export
    tampered = dict(weights)
    tampered["model.layers.0.mlp.down_proj.weight"] = weights["model.layers.0.mlp.down_proj.weight"] * 1.5
    report = measure_export_parity(out, tampered, config, samples=2, decode_steps=3)
    assert report.prefill_logits_max_abs > 1e-2
    assert report.image_features_max_abs <= 1e-4
