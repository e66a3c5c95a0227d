"""Block-wise weight quantization (the math) and the three ways to write it into a graph (the encodings).

One quantizer, three encodings, so `cpu`, `orin` and `x1` variants of a model carry the same integers:
- `cpu`  — ONNX Runtime `com.microsoft.MatMulNBits`: B uint8 (N, K/block, block*bits/8), element k of a block in
  byte k//2, low nibble first (the layout ORT's own `MatMulNBitsQuantizer` writes); scales (N, K/block); zero points
  uint8 (N, ceil(K/block * bits/8)), packed the same way, or absent for symmetric (ORT then implies 2^(bits-1)).
- `orin` — `DequantizeLinear` (opset 21) of an INT4 (K, N) weight with `axis=0, block_size=B`, scale (K/B, N), no
  zero point (TensorRT 10 takes only symmetric blocked INT4), feeding the original MatMul. ORT runs it too.
- `x1`   — the same blocked DequantizeLinear as `orin`; the x1 compiler reads the integers and scales from it and
  packs them in the layout the X1 streams (targets/x1/lower_matmul.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError

from .patterns import add_initializer

MS_DOMAIN = "com.microsoft"


@dataclass
class QuantizedWeight:
    """`q` holds unsigned codes (N, K) in [0, 2^bits); value = (q - zero) * scale per (row, block)."""

    q: np.ndarray  # uint8 (N, K)
    scales: np.ndarray  # float32 (N, K/block)
    zero_points: np.ndarray | None  # uint8 (N, K/block); None = symmetric, implied 2^(bits-1)
    bits: int
    block: int

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None

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


def _codes(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmax: int) -> np.ndarray:
    safe = np.where(scale == 0, 1.0, scale)
    return np.clip(np.rint(w / safe + zero), 0, qmax)


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
) -> QuantizedWeight:
    """Quantize an (N, K) weight in blocks of `block` along K.

    `clip_grid` > 0 searches, per block, a shrink of the range in [min_clip, 1] that minimises the block's squared
    error weighted by `importance` (K,) — the mean squared activation of each input channel when calibration data
    is given, so the error that matters (on the output) is what is minimised; uniform otherwise.
    """
    n, k = w_nk.shape
    check_block(k, block, name)
    qmax = 2**bits - 1
    wb = w_nk.reshape(n, k // block, block).astype(np.float32)
    imp = (np.ones(k, np.float32) if importance is None else importance.astype(np.float32)).reshape(k // block, block)

    def attempt(ratio: float):
        if symmetric:
            amax = np.abs(wb).max(-1) * ratio
            scale = amax / (2 ** (bits - 1) - 1)  # +-7 around the implied zero 8: code 0 (-8) stays unused
            zero = np.full(scale.shape, 2 ** (bits - 1), np.float32)
        else:
            lo = np.minimum(wb.min(-1), 0) * ratio
            hi = np.maximum(wb.max(-1), 0) * ratio
            scale = (hi - lo) / qmax
            zero = np.clip(np.rint(-lo / np.where(scale == 0, 1, scale)), 0, qmax)
        q = _codes(wb, scale[..., None], zero[..., None], qmax)
        err = (((q - zero[..., None]) * scale[..., None] - wb) ** 2 * imp).sum(-1)
        return q, scale, zero, err

    q, scale, zero, err = attempt(1.0)
    for ratio in np.linspace(1.0, min_clip, clip_grid + 1)[1:] if clip_grid else []:
        q2, s2, z2, e2 = attempt(float(ratio))
        better = e2 < err
        q = np.where(better[..., None], q2, q)
        scale, zero, err = np.where(better, s2, scale), np.where(better, z2, zero), np.where(better, e2, err)
    return QuantizedWeight(
        q=q.reshape(n, k).astype(np.uint8),
        scales=scale.astype(np.float32),
        zero_points=None if symmetric else zero.astype(np.uint8),
        bits=bits,
        block=block,
    )


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
    zp = None
    if qw.zero_points is not None:
        zp = pack_nibbles(qw.zero_points) if qw.bits == 4 else qw.zero_points.copy()
    return b, qw.scales.copy(), zp


def dequantize_matmulnbits(
    b: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, *, k: int, bits: int, block: int
) -> np.ndarray:
    """Reference dequantization of MatMulNBits inputs to the (K, N) weight MatMul would use (for tests)."""
    n, kb = scales.shape
    codes = unpack_nibbles(b, block) if bits == 4 else b
    zeros = (
        np.full((n, kb), 2 ** (bits - 1), np.float32)
        if zp is None
        else (unpack_nibbles(zp, kb) if bits == 4 else zp).astype(np.float32)
    )
    w = (codes.astype(np.float32) - zeros[..., None]) * scales[..., None]
    return w.reshape(n, kb * block)[:, :k].T


def qdq_tensors(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """(signed INT4/INT8 weight (K, N), scale (K/B, N)) for a symmetric blocked DequantizeLinear on axis 0."""
    if not qw.symmetric:
        raise ConfigError(
            "int4.symmetric: the blocked DequantizeLinear encoding (orin/x1) takes symmetric "
            "quantization only (TensorRT 10 refuses zero points); set symmetric=true"
        )
    signed = qw.q.astype(np.int16) - 2 ** (qw.bits - 1)
    dtype = ml_dtypes.int4 if qw.bits == 4 else np.int8
    return np.ascontiguousarray(signed.T).astype(dtype), np.ascontiguousarray(qw.scales.T)


# --------------------------------------------------------------------------------------------------------------
# encoders: each replaces one weight MatMul's B with its quantized form; returns nodes added
# --------------------------------------------------------------------------------------------------------------
Encoder = Callable[[ir.Model, ir.Node, QuantizedWeight, str, dict], int]


def encode_matmulnbits(model: ir.Model, matmul: ir.Node, qw: QuantizedWeight, name: str, opts: dict) -> int:
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
    node = ir.node("MatMulNBits", inputs, attrs, domain=MS_DOMAIN, name=f"{matmul.name}_Q{qw.bits}")
    graph.insert_before(matmul, node)
    old = matmul.outputs[0]
    _copy_value_info(old, node.outputs[0])
    old.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
    graph.remove(matmul, safe=True)
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    graph.opset_imports.setdefault(MS_DOMAIN, 1)
    return 1


def encode_qdq(model: ir.Model, matmul: ir.Node, qw: QuantizedWeight, name: str, opts: dict) -> int:
    """Feed `matmul` from DequantizeLinear(int4 (K, N), scale (K/B, N), axis=0, block_size=B)."""
    w, scale = qdq_tensors(qw)
    graph = model.graph
    dq = ir.node(
        "DequantizeLinear",
        [add_initializer(graph, w, f"{name}.qweight"), add_initializer(graph, scale, f"{name}.scales")],
        {"axis": 0, "block_size": qw.block},
        name=f"{matmul.name}_DequantizeLinear",
    )
    dq.outputs[0].name = f"{name}.weight_dq"
    dq.outputs[0].dtype = ir.DataType.FLOAT
    dq.outputs[0].shape = ir.Shape(list(w.shape))
    graph.insert_before(matmul, dq)
    matmul.replace_input_with(1, dq.outputs[0])
    return 1


def _copy_value_info(src: ir.Value, dst: ir.Value) -> None:
    dst.name = src.name
    if src.dtype is not None:
        dst.dtype = src.dtype
    if src.shape is not None:
        dst.shape = src.shape


ENCODERS: dict[str, Encoder] = {"cpu": encode_matmulnbits, "orin": encode_qdq, "x1": encode_qdq}
