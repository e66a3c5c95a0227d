"""Sequential INT4 with asymmetric calibration (GPTAQ): the least-squares retarget, the waves, and that fitting
each layer on the partly quantized model's inputs against the float outputs lowers the end-to-end error."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx_factory import unnamed_matmul_chain

from edgekit.errors import ConfigError
from edgekit.export import DecoderSpec, build_decoder, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.names import DECODER
from edgekit.passes import PassContext, make_pass
from edgekit.passes.check import compare_outputs, run_all, session
from edgekit.passes.int4_sequential import input_fit, least_squares_target, matmul_waves, retarget_weight
from edgekit.passes.patterns import require_weight_matmuls

K = 64


def _chain(seed: int = 0, layers: int = 3, relu: bool = False, opset: int = 21) -> onnx.ModelProto:
    """`layers` MatMuls in a row (K -> K), nodes unnamed; optionally a Relu between them."""
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal((K, K)) / np.sqrt(K) for _ in range(layers)]
    return unnamed_matmul_chain(weights, relu=relu, opset=opset, name="chain")


def _feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Correlated inputs (a random mixing of Gaussian channels with decaying energy): GPTQ has directions to use."""
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(99).standard_normal((K, K)) * (0.9 ** np.arange(K))[:, None]
    return [{"x": (rng.standard_normal((64, K)) @ mix).astype(np.float32)} for _ in range(n)]


CALIB, EVALS = _feeds(32, 1), _feeds(8, 2)


def _error(proto: onnx.ModelProto, spec: str) -> tuple[float, dict]:
    model = ir.from_proto(proto)
    report = make_pass(spec)(model, PassContext(graph="m.onnx", calibration={"m.onnx": CALIB})).report
    ref = run_all(session(proto.SerializeToString()), EVALS)
    got = run_all(session(ir.to_proto(model).SerializeToString()), EVALS)  # ORT loads the unnamed result
    return compare_outputs(ref, got)[0].rel_l2, report.notes


def test_retarget_identity():
    """||W X - Q X_q||^2 = const + ||(W* - Q) X_q||^2 for every Q: the differences between two Qs agree."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 16))
    xq = x + 0.3 * rng.standard_normal(x.shape) @ rng.standard_normal((16, 16)) / 4  # correlated input error
    w = rng.standard_normal((8, 16))
    w_star = least_squares_target(w, input_fit(x, xq, ridge=0.0, damp=0.0))

    def lhs(q):
        return float(((x @ w.T - xq @ q.T) ** 2).sum())

    def rhs(q):
        return float(((xq @ (w_star - q).T) ** 2).sum())

    q1, q2 = w + 0.1 * rng.standard_normal(w.shape), np.round(w * 4) / 4
    assert lhs(q1) - lhs(q2) == pytest.approx(rhs(q1) - rhs(q2), rel=1e-8)
    assert lhs(w_star) < lhs(w)  # W* fits the float output from X_q better than W does


def test_retarget_keeps_w_where_the_inputs_did_not_change_and_takes_beta_of_the_rest():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((300, 12)), rng.standard_normal((5, 12))
    np.testing.assert_allclose(retarget_weight(w, input_fit(x, x, ridge=0.1, damp=0.01)), w, atol=1e-10)
    xq = x @ (np.eye(12) + 0.2 * rng.standard_normal((12, 12))) + 0.1 * rng.standard_normal(x.shape)
    fit = input_fit(x, xq, ridge=0.05, damp=0.01)
    gain_only, half, full = (retarget_weight(w, fit, beta=b) for b in (0.0, 0.5, 1.0))
    np.testing.assert_allclose(half, (gain_only + full) / 2, atol=1e-12)
    cosine = float((gain_only * w).sum() / np.linalg.norm(gain_only) / np.linalg.norm(w))
    assert cosine == pytest.approx(1.0) and not np.allclose(gain_only, w)  # the gain alone: W scaled
    assert not np.allclose(full, gain_only)


def test_retarget_takes_the_gain_of_noisy_inputs_in_full():
    """x_q = x + independent noise of variance v (unit-variance x): the least-squares fit from x_q is W / (1 + v),
    an isotropic gain (errors in variables), and the retarget takes it whole though most of W* - W is noise."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2048, 64)), rng.standard_normal((32, 64))
    xq = x + np.sqrt(0.25) * rng.standard_normal(x.shape)
    moved = retarget_weight(w, input_fit(x, xq, ridge=0.0, damp=0.0))
    gain = float((moved * w).sum() / (w * w).sum())
    assert gain == pytest.approx(1 / 1.25, abs=0.02)
    assert np.linalg.norm(moved - gain * w) < 0.05 * np.linalg.norm(w)  # the noisy rest left out


def test_retarget_takes_a_well_measured_linear_error_in_full_and_shrinks_a_noisy_fit():
    """Each row's anisotropic move is scaled by its James-Stein factor: where the upstream error is linear in the
    inputs, the move is W*'s; where it is not (an even function of x, uncorrelated with it) and the tokens are
    few, W* fits their noise and is worse than W on new tokens, while the retarget is better than both."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 32))
    mix = np.eye(32) + 0.3 * rng.standard_normal((32, 32)) / np.sqrt(32)
    x = rng.standard_normal((4096, 32))
    fit = input_fit(x, x @ mix, ridge=0.0, damp=0.0)
    np.testing.assert_allclose(retarget_weight(w, fit), least_squares_target(w, fit), atol=1e-6)
    x, val = rng.standard_normal((96, 32)), rng.standard_normal((4096, 32))

    def quantized(v):
        return v + 0.5 * (v**2 - 1)

    def held_out(wp):
        return float(((val @ w.T - quantized(val) @ wp.T) ** 2).mean())

    fit = input_fit(x, quantized(x), ridge=0.0, damp=0.0)
    full = least_squares_target(w, fit)
    assert held_out(full) > held_out(w)  # 32 coefficients per row from 96 tokens: W* fits their noise
    assert held_out(retarget_weight(w, fit)) < 0.8 * held_out(w)


def test_waves_follow_the_decoder_layers():
    """q/k/v share a wave, then o_proj, gate/up, down, the next layer, and lm_head last."""
    cfg = ModelConfig(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    model = build_decoder(random_weights(cfg, 0), DecoderSpec.from_model_config(cfg))
    waves = matmul_waves(model, require_weight_matmuls(model, "int4", DECODER))
    short = [sorted(m.name.split(".")[-1] for m in wave) for wave in waves]
    layer = [["k_proj", "q_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    assert short == layer + layer + [["lm_head"]], short


def test_sequential_asymmetric_calibration_lowers_the_end_to_end_error():
    """A chain whose later MatMuls' inputs change once the earlier ones are quantized: fitting each on its
    quantized inputs against the float output (held-out feeds) beats GPTQ on the float model's inputs, and the
    target's corrected rest beats its gain alone."""
    proto = _chain()
    base = "int4:block=32,method=gptq,symmetric=false"
    plain, notes_plain = _error(proto, f"{base},sequential=false")
    gain_only, _ = _error(proto, f"{base},retarget=0")
    gptaq, notes = _error(proto, f"{base},retarget=1")
    assert notes_plain["sequential_waves"] == 0 and notes["sequential_waves"] == 3
    assert gptaq < 0.9 * plain, (gptaq, plain)
    assert gptaq < gain_only, (gptaq, gain_only)


@pytest.mark.parametrize("weight_format", ["matmulnbits", "qdq-blocked"])
def test_default_is_sequential_and_valid_on_unnamed_nodes(weight_format):
    """The default (awq-gptq, sequential) on an unnamed graph with a Relu: ORT loads the result, for MatMulNBits
    and for the blocked DequantizeLinear encoding (integer symmetric there), and it beats the non-sequential run."""
    proto = _chain(seed=3, relu=True)
    err, notes = _error(proto, f"int4:block=32,format={weight_format}")
    plain, _ = _error(proto, f"int4:block=32,format={weight_format},sequential=false")
    assert notes["sequential_waves"] == 3 and notes["method"] == "awq-gptq"
    assert err < plain, (err, plain)


def test_dequantizelinear_below_opset_21_is_not_captured_sequentially():
    """qdq-blocked (orin, x1) is opset-21 DequantizeLinear: on a graph handed to the pass below it (edgekit optimize
    raises the opset first) the partly encoded model cannot run, so the MatMuls are fitted on the float inputs."""
    model = ir.from_proto(_chain(opset=17))
    notes = make_pass("int4:block=32,format=qdq-blocked")(
        model, PassContext(graph="m.onnx", calibration={"m.onnx": CALIB})
    )
    assert notes.report.notes["sequential_waves"] == 0


def test_sequential_is_refused_for_methods_without_gptq():
    with pytest.raises(ConfigError, match="sequential"):
        make_pass("int4:method=awq,sequential=true")


@pytest.mark.parametrize(
    "spec",
    [
        "int4:method=gptq,sequential=false,retarget=1",
        "int4:method=rtn,retarget=0",
        "int4:method=rtn,retarget=0.35",  # the default's value set explicitly is still set (it passed before)
    ],
)
def test_retarget_is_refused_where_it_would_be_ignored(spec):
    with pytest.raises(ConfigError, match="retarget"):
        make_pass(spec)
    make_pass("int4:method=gptq,retarget=1")  # sequential by default: taken
