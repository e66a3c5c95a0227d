"""Block-wise weight quantization (the math) and the two ways to write a weight MatMul's quantized B into a graph
(the encoders of the weight formats `matmulnbits` and `qdq-blocked`, registered in `weight_formats.py`).

One quantizer, several formats, so the variants of a model for every target carry the same integers:
- `matmulnbits` — ONNX Runtime `com.microsoft.MatMulNBits`: B uint8 (N, K/block, block*bits/8), element k of a block in
  byte k//2, low nibble first (the layout ORT's own `MatMulNBitsQuantizer` writes); scales (N, K/block); zero points
  uint8 (N, ceil(K/block * bits/8)), packed the same way, or absent for symmetric (ORT then implies 2^(bits-1)), or
  float (N, K/block) in the scales' type (float zero points, as ORT's HQQ writes them; MatMulNBits takes both).
- `qdq-blocked` — `DequantizeLinear` (opset 21) of an INT4 (K, N) weight with `axis=0, block_size=B`, scale
  (K/B, N), no zero point (TensorRT 10 takes only symmetric blocked INT4), feeding the original MatMul. ORT runs it
  too, and the x1 compiler reads the integers and scales from it and packs them in the layout the X1 streams
  (targets/x1/lower_matmul.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.onnx_model import NodeNames

from .patterns import add_initializer

MS_DOMAIN = "com.microsoft"


@dataclass
class QuantizedWeight:
    """`q` holds unsigned codes (N, K) in [0, 2^bits); value = (q - zero) * scale per (row, block)."""

    q: np.ndarray  # uint8 (N, K)
    scales: np.ndarray  # float32 (N, K/block)
    zero_points: np.ndarray | None  # uint8 (N, K/block), or float32 (float zero points); None = symmetric
    bits: int
    block: int

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None

    @property
    def float_zeros(self) -> bool:
        return self.zero_points is not None and self.zero_points.dtype != np.uint8

    def zeros(self) -> np.ndarray:
        if self.zero_points is not None:
            return self.zero_points.astype(np.float32)
        return np.full(self.scales.shape, 2 ** (self.bits - 1), np.float32)

    def dequantize(self) -> np.ndarray:
        """(N, K) float32."""
        n, k = self.q.shape
        blocks = self.q.reshape(n, k // self.block, self.block).astype(np.float32)
        return ((blocks - self.zeros()[..., None]) * self.scales[..., None]).reshape(n, k)


def check_block(k: int, block: int, tensor: str) -> None:
    if k % block:
        raise ConfigError(
            f"int4.block: {block} does not divide K={k} of {tensor}; choose a block that does "
            f"(e.g. {', '.join(str(b) for b in (16, 32, 64, 128) if k % b == 0) or 'none fits'})"
        )


def round_codes(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmax: int) -> np.ndarray:
    safe = np.where(scale == 0, 1.0, scale)
    return np.clip(np.rint(w / safe + zero), 0, qmax)


def block_error(d: np.ndarray, imp: np.ndarray | None, hessian: np.ndarray | None) -> np.ndarray:
    """Per (row, block) error of a dequantization error `d` (N, G, B): `d H d` with each block's activation Gram
    `hessian` (G, B, B) (the block's share of the output error, cross-channel terms included), else `sum imp d^2`
    with per-channel weights `imp` (G, B) (uniform: plain squared error)."""
    if hessian is not None:
        dg = np.ascontiguousarray(d.swapaxes(0, 1))  # (G, N, B): one batched matmul per block
        return (np.matmul(dg, hessian) * dg).sum(-1).T
    return (d * d * imp).sum(-1) if imp is not None else (d * d).sum(-1)


def quantize_blocks(
    w_nk: np.ndarray,
    block: int,
    *,
    bits: int = 4,
    symmetric: bool = True,
    importance: np.ndarray | None = None,
    clip_grid: int = 0,
    min_clip: float = 0.7,
    name: str = "weight",
    scale_search: bool = False,
    signed_scales: bool = False,
    hessian: np.ndarray | None = None,
    refine: int = 0,
    float_zeros: bool = False,
) -> QuantizedWeight:
    """Quantize an (N, K) weight in blocks of `block` along K.

    The scale of a block is chosen among candidates by the block's error (`block_error`): weighted by
    `importance` (K,) (each input channel's mean squared activation) or, sharper, by `hessian` (K/B, B, B) (each
    block's activation Gram matrix, the AWQ-style output error); plain squared error when neither is given.
    - `clip_grid` > 0 adds range shrinks in [min_clip, 1].
    - `scale_search` (symmetric) spends the whole signed grid -8..7 as ONNX Runtime does: scale = w_absmax / -8,
      keeping the sign of the abs-max element so that element lands exactly on -8 (a finer step than max|w| / 7,
      which leaves code -8 unused). That needs a negative scale when the abs-max is positive, allowed only with
      `signed_scales` (MatMulNBits takes them, blocked DequantizeLinear for TensorRT does not); without it,
      max/7 stays in those blocks. Without activation data this rule is applied as it is: choosing per block
      between it and max/7 (or max/7.5) by squared error measured worse output error on the bench's models.
      With `importance` or `hessian` the error sees the activations, and max/7 and max/7.5 join the
      candidates (with the clip ratios), chosen on that error.
    - `refine` > 0 re-estimates each block's scale by least squares for its codes (weighted as above) and
      re-rounds, that many times, keeping a block's new scale only where its error falls (scale estimation).
    - `float_zeros` (asymmetric): the zero point is not rounded to the grid, so the block's [min, max] (clipped)
      maps exactly onto codes 0..2^bits-1 (MatMulNBits takes float zero points; the DequantizeLinear encodings
      take none). An integer zero point must also keep 0 inside the range, which widens one-sided blocks.
    """
    n, k = w_nk.shape
    check_block(k, block, name)
    qmax = 2**bits - 1
    wb = w_nk.reshape(n, k // block, block).astype(np.float32)
    imp = None if importance is None else importance.astype(np.float32).reshape(k // block, block)
    hess = None if hessian is None else np.asarray(hessian, np.float32)

    def attempt(scale: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = round_codes(wb, scale[..., None], zero[..., None], qmax)
        err = block_error((q - zero[..., None]) * scale[..., None] - wb, imp, hess)
        return q, err

    ratios = [1.0, *(np.linspace(1.0, min_clip, clip_grid + 1)[1:] if clip_grid else [])]
    if symmetric:
        weighted = importance is not None or hessian is not None
        candidates = _symmetric_candidates(wb, bits, ratios, scale_search, signed_scales, weighted)
    else:
        candidates = _asymmetric_candidates(wb, bits, ratios, float_zeros)
    q, scale, zero, err = _best_candidate(candidates, attempt)
    if refine:
        keep_positive = symmetric and not signed_scales
        q, scale = _refine_scales(wb, q, scale, zero, err, imp, hess, attempt, refine, keep_positive)
    return QuantizedWeight(
        q=q.reshape(n, k).astype(np.uint8),
        scales=scale.astype(np.float32),
        zero_points=None if symmetric else zero.astype(np.float32 if float_zeros else np.uint8),
        bits=bits,
        block=block,
    )


Candidate = tuple[np.ndarray, np.ndarray]  # (scale, zero), (N, G) each
Attempt = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # (scale, zero) -> (codes, error)


def _symmetric_candidates(
    wb: np.ndarray, bits: int, ratios: list[float], scale_search: bool, signed_scales: bool, weighted: bool
) -> list[Candidate]:
    """`quantize_blocks`' symmetric scales for the blocks `wb` (N, G, B), each range ratio in turn (see there)."""
    half = 2 ** (bits - 1)
    amax = np.abs(wb).max(-1)
    zero = np.full(amax.shape, half, np.float32)
    narrow = amax / (half - 1)  # +-7 around the implied zero 8: exact on the extreme, code -8 unused
    if scale_search:
        # ORT's choice: the abs-max element lands exactly on -8 (a negative scale when it is positive)
        signed = np.take_along_axis(wb, np.abs(wb).argmax(-1)[..., None], -1)[..., 0]
        ort = signed / -half
        narrow = np.where(signed_scales | (ort > 0), ort, narrow)
    candidates = []
    for ratio in ratios:
        candidates.append((narrow * ratio, zero))
        if scale_search and weighted:  # with the activations in the error, clipping the extreme is judged
            candidates.append((amax * ratio / (half - 1), zero))
            candidates.append((amax * ratio / (half - 0.5), zero))
    return candidates


def _asymmetric_candidates(wb: np.ndarray, bits: int, ratios: list[float], float_zeros: bool) -> list[Candidate]:
    """`quantize_blocks`' asymmetric (scale, zero point) pairs, each range ratio in turn: the zero point on the
    grid with 0 kept in the range, or (`float_zeros`) off it, mapping [min, max] onto the codes exactly."""
    qmax = 2**bits - 1
    candidates = []
    for ratio in ratios:
        lo = (wb.min(-1) if float_zeros else np.minimum(wb.min(-1), 0)) * ratio
        hi = (wb.max(-1) if float_zeros else np.maximum(wb.max(-1), 0)) * ratio
        scale = (hi - lo) / qmax
        if float_zeros:  # a constant block: any scale > 0 with its value on a code
            scale = np.where(scale > 0, scale, np.maximum(np.abs(lo), 1e-12))
            candidates.append((scale, -lo / scale))
        else:
            candidates.append((scale, np.clip(np.rint(-lo / np.where(scale == 0, 1, scale)), 0, qmax)))
    return candidates


def _best_candidate(
    candidates: list[Candidate], attempt: Attempt
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per block, the candidate with the lowest error (the first on a tie): (codes, scale, zero, error)."""
    scale, zero = candidates[0]
    q, err = attempt(scale, zero)
    for s2, z2 in candidates[1:]:
        q2, e2 = attempt(s2, z2)
        better = e2 < err
        q = np.where(better[..., None], q2, q)
        scale, zero, err = np.where(better, s2, scale), np.where(better, z2, zero), np.where(better, e2, err)
    return q, scale, zero, err


def _refine_scales(
    wb: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    err: np.ndarray,
    imp: np.ndarray | None,
    hess: np.ndarray | None,
    attempt: Attempt,
    steps: int,
    keep_positive: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Up to `steps` rounds of a least-squares scale for the current codes, re-rounded, each block keeping it
    only where its error falls; (codes, scale)."""
    for _ in range(steps):
        s2 = _least_squares_scale(wb, q - zero[..., None], imp, hess, scale)
        if keep_positive:
            s2 = np.where(s2 > 0, s2, scale)
        q2, e2 = attempt(s2, zero)
        better = e2 < err
        if not better.any():
            break
        q = np.where(better[..., None], q2, q)
        scale, err = np.where(better, s2, scale), np.where(better, e2, err)
    return q, scale


def _least_squares_scale(
    wb: np.ndarray, c: np.ndarray, imp: np.ndarray | None, hess: np.ndarray | None, old: np.ndarray
) -> np.ndarray:
    """Per block, the scale s minimising the weighted error of s * c against w for fixed codes c (N, G, B)."""
    if hess is not None:
        hc = np.matmul(np.ascontiguousarray(c.swapaxes(0, 1)), hess).swapaxes(0, 1)  # H symmetric: (c H)
        num, den = (hc * wb).sum(-1), (hc * c).sum(-1)
    else:
        weight = imp if imp is not None else 1.0
        num, den = (weight * c * wb).sum(-1), (weight * c * c).sum(-1)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), old).astype(np.float32)


# --------------------------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------------------------
def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pairs along the last axis into bytes, element 2i in the low nibble (an odd length is zero-padded)."""
    codes = codes.astype(np.uint8)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: np.ndarray, length: int) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out[..., :length]


def matmulnbits_tensors(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(B, scales, zero_points) exactly as `com.microsoft.MatMulNBits` reads them."""
    n, k = qw.q.shape
    kb = k // qw.block
    blocks = qw.q.reshape(n, kb, qw.block)
    b = pack_nibbles(blocks) if qw.bits == 4 else blocks.copy()
    zp = qw.zero_points
    if zp is not None and qw.float_zeros:
        zp = zp.astype(qw.scales.dtype)
    elif zp is not None:
        zp = pack_nibbles(zp) if qw.bits == 4 else zp.copy()
    return b, qw.scales.copy(), zp


def dequantize_matmulnbits(
    b: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, *, k: int, bits: int, block: int
) -> np.ndarray:
    """Reference dequantization of MatMulNBits inputs to the (K, N) weight MatMul would use (for tests)."""
    n, kb = scales.shape
    codes = unpack_nibbles(b, block) if bits == 4 else b
    if zp is None:
        zeros = np.full((n, kb), 2 ** (bits - 1), np.float32)
    elif zp.dtype != np.uint8:  # float zero points
        zeros = zp.reshape(n, kb).astype(np.float32)
    else:
        zeros = (unpack_nibbles(zp, kb) if bits == 4 else zp).astype(np.float32)
    w = (codes.astype(np.float32) - zeros[..., None]) * scales[..., None]
    return w.reshape(n, kb * block)[:, :k].T


def qdq_tensors(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """(signed INT4/INT8 weight (K, N), scale (K/B, N)) for a symmetric blocked DequantizeLinear on axis 0."""
    if not qw.symmetric:
        raise ConfigError(
            "int4.symmetric: the blocked DequantizeLinear format (qdq-blocked) takes symmetric "
            "quantization only (TensorRT 10 refuses zero points); set symmetric=true"
        )
    signed = qw.q.astype(np.int16) - 2 ** (qw.bits - 1)
    dtype = ml_dtypes.int4 if qw.bits == 4 else np.int8
    return np.ascontiguousarray(signed.T).astype(dtype), np.ascontiguousarray(qw.scales.T)


# --------------------------------------------------------------------------------------------------------------
# encoders: each replaces one weight MatMul's B with its quantized form; returns (nodes added, nodes removed).
# `opts` may hold `accuracy_level` (MatMulNBits') and `node_names` (a `NodeNames` shared over one pass)
# --------------------------------------------------------------------------------------------------------------
Encoder = Callable[[ir.Model, ir.Node, QuantizedWeight, str, dict], tuple[int, int]]


def encode_matmulnbits(model: ir.Model, matmul: ir.Node, qw: QuantizedWeight, name: str, opts: dict) -> tuple[int, int]:
    """Replace `matmul` (A @ B) with MatMulNBits(A, packed B, scales[, zero points])."""
    n, k = qw.q.shape
    b, scales, zp = matmulnbits_tensors(qw)
    graph = model.graph
    inputs = [
        matmul.inputs[0],
        add_initializer(graph, b, f"{name}.qweight"),
        add_initializer(graph, scales, f"{name}.scales"),
    ]
    if zp is not None:
        inputs.append(add_initializer(graph, zp, f"{name}.qzeros"))
    attrs = {"K": k, "N": n, "bits": qw.bits, "block_size": qw.block}
    if opts.get("accuracy_level"):
        attrs["accuracy_level"] = int(opts["accuracy_level"])
    node = ir.node("MatMulNBits", inputs, attrs, domain=MS_DOMAIN, name=_node_name(model, opts, f"{name}_Q{qw.bits}"))
    graph.insert_before(matmul, node)
    old = matmul.outputs[0]
    _copy_value_info(old, node.outputs[0])
    old.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
    graph.remove(matmul, safe=True)
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    graph.opset_imports.setdefault(MS_DOMAIN, 1)
    return 1, 1  # the MatMul itself became MatMulNBits


def encode_qdq(model: ir.Model, matmul: ir.Node, qw: QuantizedWeight, name: str, opts: dict) -> tuple[int, int]:
    """Feed `matmul` from DequantizeLinear(int4 (K, N), scale (K/B, N), axis=0, block_size=B)."""
    w, scale = qdq_tensors(qw)
    graph = model.graph
    dq = ir.node(
        "DequantizeLinear",
        [add_initializer(graph, w, f"{name}.qweight"), add_initializer(graph, scale, f"{name}.scales")],
        {"axis": 0, "block_size": qw.block},
        name=_node_name(model, opts, f"{name}_DequantizeLinear"),
    )
    dq.outputs[0].name = f"{name}.weight_dq"
    dq.outputs[0].dtype = ir.DataType.FLOAT
    dq.outputs[0].shape = ir.Shape(list(w.shape))
    graph.insert_before(matmul, dq)
    matmul.replace_input_with(1, dq.outputs[0])
    return 1, 0


def _node_name(model: ir.Model, opts: dict, preferred: str) -> str:
    """A unique node name built from the weight's (unique) name: the caller's `NodeNames` when it passes one in
    `opts["node_names"]` (one scan of the graph per pass), else a fresh one."""
    names = opts.get("node_names")
    if names is None:
        names = opts["node_names"] = NodeNames(model.graph)
    return names.take(preferred)


def _copy_value_info(src: ir.Value, dst: ir.Value) -> None:
    dst.name = src.name
    if src.dtype is not None:
        dst.dtype = src.dtype
    if src.shape is not None:
        dst.shape = src.shape
