"""The X1 emulator's C kernels (targets/x1/_native.c) against its numpy kernels: bit for bit, so a report does not
depend on whether the module was built. Every test runs both paths through the real switch."""

from __future__ import annotations

import os

import numpy as np
import pytest

from edgekit.targets.x1.compiler import compile_model
from edgekit.targets.x1.emulator import Emulator, KVCache
from edgekit.targets.x1.kernels import IntGemm, native, to_fp16
from edgekit.targets.x1.machine import load_machine

from x1_support import fixed_scenario, small_kv_machine, tiny_int4_dir

needs_native = pytest.mark.skipif(
    not native.available, reason="edgekit.targets.x1._native was not built (no C compiler at install time)"
)


@pytest.fixture
def switch():
    """Restores the switch whatever a test leaves it at."""
    prev = native.enabled
    yield native
    native.set(prev)


@pytest.fixture(params=["fastest", "portable"])
def paths(request):
    """The kernels this CPU picks (AVX2 / F16C on x86-64), then the portable ones an arm64 device runs."""
    native.lib.use_portable(request.param == "portable")
    yield request.param
    native.lib.use_portable(False)


def both(fn):
    native.set(False)
    a = fn()
    native.set(True)
    b = fn()
    return a, b


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, except that any NaN equals any NaN (payloads are not part of the spec)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    keep = ~np.isnan(a)
    return np.array_equal(a[keep].view(np.uint32), b[keep].view(np.uint32))


@needs_native
@pytest.mark.parametrize("k,n,group,bits", [(192, 320, 64, 4), (512, 192, 64, 4), (192, 588, 64, 8), (96, 40, 32, 4)])
@pytest.mark.parametrize("rows", [1, 3, 29])
def test_int_gemm_is_bit_identical_to_numpy(switch, paths, k, n, group, bits, rows):
    rng = np.random.default_rng(k + n + rows)
    lim = 8 if bits == 4 else 128
    g = IntGemm(
        rng.integers(-lim, lim, (k, n)).astype(np.float32),
        (rng.random((n, k // group)) * 0.05).astype(np.float16),
        group,
    )
    for trial in range(8):
        x = (rng.standard_normal((1, rows, k)) * [1e-3, 1.0, 30.0, 1e4][trial % 4]).astype(np.float32)
        if trial == 1:
            x[0, 0] = 0.0  # zero row: the zero-scale guard
        if trial == 2:
            x[0, -1] = 1e-35  # a row scale below the one-row fast path's safe range
        if trial == 3:
            x *= 1e5  # outputs past +-65504: saturated
        if trial == 5:
            x[0, 0, 3] = np.nan  # NaN spreads to the whole row, as a float matmul spreads it
        mask = None if trial % 2 else rng.integers(0, 2, n).astype(np.float32)
        a, b = both(lambda x=x, mask=mask: g(x, mask))
        assert same_bits(a, b), f"trial {trial}"


@needs_native
def test_fused_gemm_and_int8_codes_stay_exact(switch, paths):
    rng = np.random.default_rng(3)
    parts = [
        IntGemm(rng.integers(-8, 8, (128, n)).astype(np.float32), (rng.random((n, 2)) * 0.1).astype(np.float16), 64)
        for n in (96, 32, 32)
    ]
    fused = IntGemm.fused(parts)
    layout = {"nk8": (np.int8, (160, 128)), "pairs8": (np.int8, (64, 160, 2))}[native.lib.gemm_layout]
    assert (fused.codes_nk.dtype, fused.codes_nk.shape) == layout
    x = rng.standard_normal((1, 1, 128)).astype(np.float32)
    a, b = both(lambda: fused(x))
    assert same_bits(a, b)
    native.set(True)
    assert same_bits(np.concatenate([p(x) for p in parts], -1), b)


@needs_native
def test_fp16_rounding_is_numpys_on_random_bit_patterns_and_edges(switch, paths):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_003, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array(
        [0.0, -0.0, 65504, 65519.99, 65520, -65520, 1e-8, 2.0**-14, 2.0**-24, 3 * 2.0**-25, np.inf, -np.inf, 6.1e-5],
        np.float32,
    )
    for x in (bits, edges, bits[:17]):  # the vector loop and its scalar tail
        out = np.empty_like(x)
        native.lib.fp16_round(x, out, False)
        with np.errstate(over="ignore"):
            ref = x.astype(np.float16).astype(np.float32)
        assert same_bits(ref, out)
        a, b = both(lambda x=x: to_fp16(x.copy()))
        assert same_bits(a, b)
        a, b = both(lambda x=x: to_fp16(x.copy(), owned=True))
        assert same_bits(a, b)


@needs_native
def test_kv_append_stores_the_same_codes_scales_and_values(switch):
    rng = np.random.default_rng(5)
    steps = []
    for n in (7, 1, 1, 60):  # prefill, two decode steps, then growth past the capacity
        k = (rng.standard_normal((1, 2, n, 64)) * 3).astype(np.float32)
        v = (rng.standard_normal((1, 2, n, 64)) * 1e3).astype(np.float32)
        k[0, 0, 0, :32] = 0.0  # an all-zero group: the zero-scale guard
        v[0, 1, 0, 5] = -1e-9  # a tiny negative value: code +0.0
        k[0, 1, -1, 7] = 1e6  # a group scale past FP16's range: inf, codes 0
        steps.append((k, v))

    def fill():
        kv = KVCache(2, 16, 32)
        for k, v in steps:
            for layer in range(2):
                kv.append(layer, k, v)
        return kv

    with np.errstate(over="ignore"):  # the out-of-range scale, on the numpy path
        a, b = both(fill)
    for layer in range(2):
        for x, y in zip(a.full(layer), b.full(layer)):
            assert x.dtype == y.dtype and same_bits(x.astype(np.float32), y.astype(np.float32))
        assert same_bits(a.values(layer), b.values(layer))
        codes = b.rows[layer].codes[..., : b.lengths[layer], :]
        assert not np.signbit(codes[codes == 0]).any()  # zero codes are +0.0, as int8 0 converts


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    return tiny_int4_dir(tmp_path_factory.mktemp("x1n"))


@needs_native
@pytest.mark.parametrize("machine_kind", ["default", "small_kv"])
def test_whole_programs_give_identical_outputs_and_totals(switch, paths, int4_dir, machine_kind):
    """Prefill, decode with and without head masks (the attention kernel), KV spill, vision and embed programs."""
    m = load_machine() if machine_kind == "default" else small_kv_machine(load_machine())
    runs = {}
    for on in (False, True):
        native.set(on)
        runs[on] = fixed_scenario(Emulator(compile_model(int4_dir, m), m))
    for a, b in zip(runs[False], runs[True]):
        assert a.totals == b.totals
        assert a.outputs.keys() == b.outputs.keys()
        for name in a.outputs:
            assert same_bits(a.outputs[name], b.outputs[name]), name
        assert same_bits(a.head_norms, b.head_norms) if a.head_norms is not None else b.head_norms is None


def test_switch_refuses_native_without_the_module(monkeypatch):
    monkeypatch.setattr(native, "available", False)
    with pytest.raises(RuntimeError, match="not built"):
        native.set(True)


@pytest.mark.skipif(os.environ.get("EDGEKIT_REQUIRE_NATIVE") != "1", reason="EDGEKIT_REQUIRE_NATIVE=1 not set")
def test_native_kernels_were_built_where_ci_requires_them():
    """CI sets EDGEKIT_REQUIRE_NATIVE=1: a silently failed optional build would otherwise only show as skips."""
    assert native.available and native.enabled


def test_environment_switches_the_native_kernels_off():
    import subprocess
    import sys

    code = "from edgekit.targets.x1.kernels import native; print(native.available, native.enabled)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "EDGEKIT_X1_NATIVE": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[1] == "False"


@needs_native
def test_edge_layouts_and_signs_match_numpy(switch):
    """From review: an all -0.0 row (numpy's sum starts at +0.0), transposed views (numpy reduces them in
    another order, so they stay on numpy), zero-row GEMMs with an odd group, and empty KV appends."""
    from edgekit.targets.x1.onnx_ops import layernorm

    rng = np.random.default_rng(11)
    scale = rng.standard_normal(16).astype(np.float32)
    for x in (
        np.full((2, 16), -0.0, np.float32),
        rng.standard_normal((16, 40)).astype(np.float32).T[:, :16].copy(),
        rng.standard_normal((40, 16)).astype(np.float32).T.T,
        rng.standard_normal((16, 16)).astype(np.float32).T,
    ):
        a, b = both(lambda x=x: layernorm(x, scale))
        assert same_bits(a, b)
    g = IntGemm(rng.integers(-8, 8, (6, 17)).astype(np.float32), (rng.random((17, 2)) * 0.1).astype(np.float16), 3)
    a, b = both(lambda: g(np.zeros((1, 0, 6), np.float32)))
    assert a.shape == b.shape == (1, 0, 17)
    kv = KVCache(1, 8, 4)
    native.set(True)
    kv.append(0, np.zeros((1, 1, 0, 8), np.float32), np.zeros((1, 1, 0, 8), np.float32))
    assert kv.lengths == [0]


@needs_native
def test_weights_prepared_for_another_layout_are_refused_not_misread():
    """use_portable() changes the layout the GEMM reads; weights prepared before it must fail loudly."""
    g = IntGemm(np.ones((8, 4), np.float32), np.ones((4, 1), np.float16), 8)
    x = np.ones((1, 8), np.float32)
    prev = native.set(True)
    try:
        native.lib.use_portable(native.lib.gemm_layout == "pairs8")
        if g.codes_nk is not None and g.codes_nk.ndim == (3 if native.lib.gemm_layout == "pairs8" else 2):
            pytest.skip("this CPU has only the portable layout")
        with pytest.raises(ValueError, match="inconsistent shapes"):
            g(x)
    finally:
        native.lib.use_portable(False)
        native.set(prev)
