"""Every INT4 method at both symmetries on a foreign model: a residual MLP with heavy-tailed (Student-t) weights and
outlier input channels, nodes unnamed, calibrated on a few feeds of its own. No method that calibrates may be
worse than round-to-nearest at the same symmetry.

Why this model, two faults of the asymmetric path (float zero points, cpu) that it shows and the bench's models,
at 4096 calibration tokens, do not:
- GPTQ's refit solved the block scales and offsets on the raw calibration Hessian; with about as few tokens as a
  row has parameters (2 x K / block: 16 here for K = 256, fed 16 tokens) it fits the calibration outputs exactly
  and lands anywhere off them (gptq asym 0.46 against RTN's 0.18; 0.087 on the sweep's Hessian).
- AWQ gave a channel zero on every calibration token a scale set by its 1e-8 floor (tiny), and float zero points
  have no exact 0 for its weight to round to: its rounding error came back divided by that scale (awq-gptq asym
  13.1, and 0.77 with the refit fixed; 0.077 with such channels left unscaled).
Symmetric, every method is unchanged (rtn 0.2489, awq 0.1469, gptq 0.1106, awq-gptq 0.0988)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.passes import PassContext, make_pass
from edgekit.passes.calibration import capture_values
from edgekit.passes.check import compare_outputs, run_all, session
from edgekit.passes.gptq import gptq_quantize, hessian
from edgekit.passes.int4_encode import quantize_blocks

K, HIDDEN, N_OUT = 64, 256, 32
OUTLIERS = [5, 21, 40, 58]
CALIBRATED = ("awq", "gptq", "awq-gptq")


def residual_mlp(seed: int = 0) -> onnx.ModelProto:
    """y = (x + relu(relu(x @ up) @ mid) @ down) @ out, Student-t (3 dof) weights, every node unnamed (as
    onnx.helper writes it when no names are given). The second ReLU, fed non-negative inputs, leaves some of its
    channels zero on all 16 calibration tokens (10 of 256) that the held-out feeds do reach."""
    rng = np.random.default_rng(seed)

    def t(k: int, n: int) -> np.ndarray:
        return (rng.standard_t(3, (k, n)) / np.sqrt(k)).astype(np.float32)

    weights = {
        "up.weight": t(K, HIDDEN),
        "mid.weight": t(HIDDEN, HIDDEN),
        "down.weight": t(HIDDEN, K),
        "out.weight": t(K, N_OUT),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "up.weight"], ["u"]),
        helper.make_node("Relu", ["u"], ["r0"]),
        helper.make_node("MatMul", ["r0", "mid.weight"], ["v"]),
        helper.make_node("Relu", ["v"], ["r"]),
        helper.make_node("MatMul", ["r", "down.weight"], ["d"]),
        helper.make_node("Add", ["x", "d"], ["s"]),
        helper.make_node("MatMul", ["s", "out.weight"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "residual_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N_OUT])],
        [numpy_helper.from_array(w, name) for name, w in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def feeds(n: int, tokens: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((tokens, K)).astype(np.float32)
        x[:, OUTLIERS] *= 30
        out.append({"x": x})
    return out


PROTO = residual_mlp()
CALIB, EVALS = feeds(2, 8, 1), feeds(8, 32, 2)  # 16 calibration tokens: down's 2 x 256 / 32 parameters per row
REF = run_all(session(PROTO.SerializeToString()), EVALS)


def error(spec: str) -> float:
    model = ir.from_proto(PROTO)
    make_pass(spec)(model, PassContext(graph="mlp.onnx", calibration={"mlp.onnx": CALIB}))
    return compare_outputs(REF, run_all(session(ir.to_proto(model).SerializeToString()), EVALS))[0].rel_l2


@pytest.mark.parametrize("symmetric", [True, False])
def test_no_calibrated_method_is_worse_than_rtn_at_the_same_symmetry(symmetric):
    """The bug: asymmetric gptq and awq-gptq (the default method) measured 0.46 / 13.1 here against RTN's 0.18
    (symmetric: 0.11 / 0.10 against 0.25). HQQ uses no data and is held only to RTN's neighbourhood."""
    assert all(not n.name for n in PROTO.graph.node)
    sym = str(symmetric).lower()
    errors = {m: error(f"int4:block=32,method={m},symmetric={sym}") for m in ("rtn", "hqq", *CALIBRATED)}
    rtn = errors["rtn"]
    worse = {m: round(errors[m], 4) for m in CALIBRATED if errors[m] > rtn}
    assert not worse, f"symmetric={sym}: worse than rtn ({rtn:.4f}): {worse}"
    assert min(errors["gptq"], errors["awq-gptq"]) < 0.6 * rtn, errors  # and the GPTQ methods gain clearly
    assert errors["hqq"] < 1.1 * rtn, errors


def test_default_is_no_worse_than_rtn_at_either_symmetry():
    """The pass as users run it (awq-gptq, symmetry chosen per MatMul on held-out tokens). With only the refit
    fixed it chose asymmetric here and measured 0.77, AWQ's scale on the never-active channels undoing it."""
    rtn = min(error(f"int4:block=32,method=rtn,symmetric={sym}") for sym in ("true", "false"))
    assert error("int4:block=32") < rtn


def test_awq_leaves_channels_never_seen_in_calibration_unscaled():
    """A channel zero on every calibration token keeps scale 1 (its inverse folded into the Mul in front of
    `down`); the others are normalised among themselves, so none gets the 1e-8 floor's tiny scale."""
    model = ir.from_proto(PROTO)
    r = capture_values(model, ["r"], CALIB)["r"]
    dead = np.abs(r).sum(0) == 0
    assert dead.any() and not dead.all()
    make_pass("int4:block=32,method=awq,symmetric=false")(
        model, PassContext(graph="mlp.onnx", calibration={"mlp.onnx": CALIB})
    )
    inv = model.graph.initializers["down.awq_inv_scale"].const_value.numpy()
    np.testing.assert_array_equal(inv[dead], 1.0)
    live = 1.0 / inv[~dead]
    assert np.isclose(np.sqrt(live.max() * live.min()), 1.0, rtol=1e-4) and live.min() > 0.05


def test_float_zero_refit_does_not_fit_the_calibration_noise():
    """With as few calibration tokens as parameters per row, the refit of GPTQ's block scales and offsets solves on
    the same damped, shrunk Hessian as the sweep: on held-out inputs it beats RTN and stays level with integer zero
    points (no refit). On the raw Hessian it fitted the 32 tokens exactly: 0.61 against RTN's 0.11 (0.79 with the
    code sweep), integer zero points 0.075."""
    rng = np.random.default_rng(0)
    k, n, tokens = 512, 64, 32  # 2 x 512 / 32 = 32 parameters per row
    w = rng.standard_t(3, (n, k)) / np.sqrt(k)
    mix = rng.standard_t(3, (128, k)) / np.sqrt(128)

    def inputs(t: int) -> np.ndarray:
        x = rng.standard_normal((t, 128))
        x[:, [3, 40]] *= 10
        return np.maximum(x @ mix, 0)

    fit, val = inputs(tokens), inputs(4096)
    h, y = hessian(fit), val @ w.T

    def err(qw) -> float:
        return float(np.linalg.norm(val @ qw.dequantize().T - y) / np.linalg.norm(y))

    kw = {"clip_grid": 10, "signed_scales": True, "shrink": 0.5 * k / tokens}
    rtn = err(quantize_blocks(w.astype(np.float32), 32, symmetric=False, float_zeros=True))
    refit = err(gptq_quantize(w, h, 32, symmetric=False, float_zeros=True, **kw))
    swept = err(gptq_quantize(w, h, 32, symmetric=False, float_zeros=True, code_sweeps=1, **kw))
    integer = err(gptq_quantize(w, h, 32, symmetric=False, **kw))  # no refit: the sweep's own result
    assert refit < rtn and swept < rtn
    assert refit < 1.05 * integer and swept < 1.05 * integer
