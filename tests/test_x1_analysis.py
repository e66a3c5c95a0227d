"""Per-layer accuracy analysis (cosine, SNR) against ONNX Runtime FP32, "entire" and "single" modes."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import onnx
import pytest

from edgekit.errors import ConfigError
from edgekit.export import export_model, random_weights
from edgekit.targets.x1.analysis import (
    OrtRunner,
    analyze,
    cosine,
    decoder_prefill_feeds,
    find_layers,
    snr_db,
)

from small_model import SMALL as SMALL_MODEL

SMALL = replace(SMALL_MODEL, layers=3)  # three layers: the analysis compares a middle one


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("x1an")
    export_model(random_weights(SMALL, seed=7), SMALL, out)
    return out


@pytest.fixture(scope="module")
def decoder(onnx_dir):
    return onnx.load(str(onnx_dir / "decoder_model_merged.onnx"))


def _perturbed(model: onnx.ModelProto, weight: str, scale: float) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    rng = np.random.default_rng(0)
    for init in m.graph.initializer:
        if init.name == weight:
            a = onnx.numpy_helper.to_array(init)
            a = a + scale * a.std() * rng.standard_normal(a.shape).astype(a.dtype)
            init.CopyFrom(onnx.numpy_helper.from_array(a, init.name))
            return m
    raise AssertionError(f"no initializer {weight}")


def test_metrics():
    a = np.array([1.0, 2.0, 3.0])
    assert cosine(a, a) == 1.0 and snr_db(a, a) == math.inf
    assert cosine(a, -a) == pytest.approx(-1.0)
    assert snr_db(a, a * 1.1) == pytest.approx(20.0)  # error = 0.1 x signal -> 20 dB
    assert cosine(np.zeros(3), np.zeros(3)) == 1.0


def test_layers_and_their_boundaries(decoder):
    layers = {L.name: L for L in find_layers(decoder)}
    assert [n for n in layers if "layers." in n] == ["/model/layers.0", "/model/layers.1", "/model/layers.2"]
    l1 = layers["/model/layers.1"]
    assert "/model/layers.0/Add_1_output_0" in l1.inputs  # the residual stream from layer 0
    assert {"present.1.key", "present.1.value", "/model/layers.1/Add_1_output_0"} <= set(l1.outputs)
    assert layers["/lm_head"].outputs == ["logits"]


@pytest.mark.parametrize("mode", ["entire", "single"])
def test_identical_models_give_cosine_1_and_infinite_snr(decoder, mode):
    report = analyze(decoder, OrtRunner(decoder), decoder_prefill_feeds(decoder, seq=8), mode=mode)
    assert len(report.layers) >= 5
    for row in report.layers:
        assert row.values >= 1 and row.cosine == 1.0 and row.snr_db == math.inf and not row.flagged
    assert report.to_dict()["layers"][0]["snr_db"] == "inf"  # JSON-safe


def test_a_perturbed_layer_is_flagged_at_that_layer_in_single_mode(decoder):
    device = OrtRunner(_perturbed(decoder, "model.layers.1.mlp.down_proj.weight", 2.0))
    feeds = decoder_prefill_feeds(decoder, seq=8)
    single = analyze(decoder, device, feeds, mode="single")
    assert single.flagged == ["/model/layers.1"]
    by = {r.layer: r for r in single.layers}
    assert by["/model/layers.2"].snr_db == math.inf  # fed reference inputs: its own error only
    entire = analyze(decoder, device, feeds, mode="entire")
    flagged = entire.flagged
    assert "/model/layers.0" not in flagged
    assert {"/model/layers.1", "/model/layers.2", "/lm_head"} <= set(flagged)  # the error propagates


def test_bad_mode_is_a_config_error(decoder):
    with pytest.raises(ConfigError, match="mode"):
        analyze(decoder, OrtRunner(decoder), {}, mode="partial")


def test_vision_encoder_layers_are_found(onnx_dir):
    vision = onnx.load(str(onnx_dir / "vision_encoder.onnx"))
    names = [L.name for L in find_layers(vision)]
    assert "/vision_model/encoder/layers.0" in names
    feeds = {"pixel_values": np.random.default_rng(1).standard_normal((1, 2, 1, 32, 32)).astype(np.float32)}
    report = analyze(vision, OrtRunner(vision), feeds, mode="single")
    assert all(r.snr_db == math.inf for r in report.layers)
