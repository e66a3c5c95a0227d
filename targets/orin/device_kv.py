"""The rows' KV caches in device memory for the TensorRT run side: `rows.KVStore` on CUDA buffers, moving exactly
what `onnx_backend.HostKV` moves on numpy arrays (the row algorithm is `rows.RowBatcher`'s, shared).

Buffers, per layer and per key/value (`KVLayout` sizes them; nothing here needs a GPU to compute):
- a *home* per row, allocated at the row's first prefill and kept for the next request given that row: the
  row's cache contiguous, (1, kv_heads, length, head_dim) at its start, room for `max_positions`;
- two *batch* buffers for `max_rows` rows of `max_positions`: the decoder's past binding reads one and its
  present binding writes the other, and they swap after every step, so a run of steps over the same rows moves
  no cache at all.
A step over a new set of rows zeroes the batch it gathers into (the padding must be finite: the mask zeroes its
softmax weight, and 0 x NaN is NaN) and copies each row's home in with one `cudaMemcpy2DAsync` per row, layer and
key/value: `kv_heads` lines of `length x head_dim` floats, at the batch's pitch (`longest x head_dim`), ending
at the batch's last position (left padding). Handing the batch back is the same copy the other way. A prefill
binds the row's home as its past and a batch buffer as its present, then copies the present home (TensorRT does
not take a binding that is both input and output). Everything runs on the backend's one stream, in order.

Unverified on a device: no GPU or TensorRT was available where this was written (docs/orin.md). The copy plans
(`KVLayout.gather_copies`, `scatter_copies`) are checked against the numpy store's gather and scatter in
tests/test_orin_batched.py by applying them as cudaMemcpy2D defines a copy (rows of `width` bytes at a pitch);
that checks our offsets and pitches, not CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgekit import names
from edgekit.errors import EdgekitError

from .profiles import DECODE, max_rows

FLOAT32 = 4  # the KV cache stays FP32 in the orin graphs (trt_graphs: graph inputs and outputs are FP32)


def check_cuda(cuda_result):
    """cuda-python returns (error, *values); raise on an error, return the values."""
    err, *values = cuda_result if isinstance(cuda_result, tuple) else (cuda_result,)
    if int(err) != 0:
        raise EdgekitError(f"CUDA call failed: {err}", code="cuda_error")
    return values[0] if len(values) == 1 else values


class DeviceBuffer:
    def __init__(self, cudart, nbytes: int):
        self.cudart, self.nbytes = cudart, max(int(nbytes), 1)
        self.ptr = check_cuda(cudart.cudaMalloc(self.nbytes))

    def free(self) -> None:
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0


@dataclass(frozen=True)
class Copy2D:
    """One `cudaMemcpy2DAsync`: `height` lines of `width` bytes, from `src_offset` at `src_pitch` to
    `dst_offset` at `dst_pitch` (offsets in bytes from each buffer's start)."""

    dst_offset: int
    dst_pitch: int
    src_offset: int
    src_pitch: int
    width: int
    height: int


@dataclass(frozen=True)
class KVLayout:
    """Sizes and copy plans of the device KV cache: one layer's key (or value) tensor of one row is
    (kv_heads, length, head_dim) float32."""

    num_layers: int
    kv_heads: int
    head_dim: int
    max_positions: int  # the longest cache a row reaches (the decode profile's total_seq maximum)
    max_rows: int  # rows one decode step carries (the decode profile's batch maximum)

    @classmethod
    def of(cls, decoder_profiles: list[dict], num_layers: int) -> KVLayout:
        """From the decoder's profiles: KV shape and the largest past of the decode profile (present is one
        longer)."""
        decode = next(p for p in decoder_profiles if p["name"] == DECODE)
        _, kv_heads, past, head_dim = decode["shapes"][names.past_key(0)]["max"]
        return cls(num_layers, kv_heads, head_dim, past + 1, max_rows(decoder_profiles))

    @property
    def tensors(self) -> int:
        """Key and value per layer."""
        return 2 * self.num_layers

    def nbytes(self, rows: int, length: int) -> int:
        """One (rows, kv_heads, length, head_dim) tensor."""
        return rows * self.kv_heads * length * self.head_dim * FLOAT32

    @property
    def home_bytes(self) -> int:
        return self.nbytes(1, self.max_positions)

    @property
    def batch_bytes(self) -> int:
        return self.nbytes(self.max_rows, self.max_positions)

    @property
    def device_bytes(self) -> int:
        """All of it, every row's home allocated: `max_rows` homes and two batches, per tensor."""
        return self.tensors * (self.max_rows * self.home_bytes + 2 * self.batch_bytes)

    def gather_copies(self, lengths: Sequence[int]) -> list[Copy2D]:
        """Row i's home (contiguous, lengths[i] long) into the batch, left-padded to the longest (one tensor)."""
        longest, line = max(lengths), self.head_dim * FLOAT32
        return [
            Copy2D(
                dst_offset=(i * self.kv_heads * longest + longest - n) * line,
                dst_pitch=longest * line,
                src_offset=0,
                src_pitch=n * line,
                width=n * line,
                height=self.kv_heads,
            )
            for i, n in enumerate(lengths)
        ]

    def scatter_copies(self, lengths: Sequence[int], longest: int) -> list[Copy2D]:
        """Row i's last lengths[i] positions of the batch (`longest` long) back home, contiguous (one tensor)."""
        line = self.head_dim * FLOAT32
        return [
            Copy2D(
                dst_offset=0,
                dst_pitch=n * line,
                src_offset=(i * self.kv_heads * longest + longest - n) * line,
                src_pitch=longest * line,
                width=n * line,
                height=self.kv_heads,
            )
            for i, n in enumerate(lengths)
        ]

    def check(self, lengths: Sequence[int], longest: int) -> None:
        """What the buffers hold: refused before a copy could run past one (a bug upstream, not a request)."""
        if len(lengths) > self.max_rows or longest > self.max_positions or min(lengths, default=1) < 1:
            raise EdgekitError(
                f"{len(lengths)} rows of up to {longest} positions do not fit the device KV cache "
                f"({self.max_rows} rows of {self.max_positions})"
            )


class DeviceKV:
    """`rows.KVStore` on device buffers. `decode(x, mask, positions, past_len, past, present)` runs the decoder
    engine with the KV bindings given as {tensor name: device pointer} (`TrtBackend._decode`)."""

    def __init__(self, cudart, stream, layout: KVLayout, decode):
        self.cudart, self.stream, self.layout, self.decode = cudart, stream, layout, decode
        self.d2d = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self.batches = [[DeviceBuffer(cudart, layout.batch_bytes) for _ in range(layout.tensors)] for _ in range(2)]
        self.live = 0  # the batch buffer that holds the batch's cache
        self.homes: dict[int, list[DeviceBuffer]] = {}

    # bindings --------------------------------------------------------------------------------------------------
    def _bind(self, buffers: list[DeviceBuffer], past: bool) -> dict[str, int]:
        key, value = (names.past_key, names.past_value) if past else (names.present_key, names.present_value)
        out = {}
        for layer in range(self.layout.num_layers):
            out[key(layer)], out[value(layer)] = buffers[2 * layer].ptr, buffers[2 * layer + 1].ptr
        return out

    def past(self, batch: int) -> dict[str, int]:
        return self._bind(self.batches[batch], past=True)

    def present(self, batch: int) -> dict[str, int]:
        return self._bind(self.batches[batch], past=False)

    def _home(self, row: int) -> list[DeviceBuffer]:
        if row not in self.homes:
            self.homes[row] = [DeviceBuffer(self.cudart, self.layout.home_bytes) for _ in range(self.layout.tensors)]
        return self.homes[row]

    def _copy(self, dst: int, src: int, c: Copy2D) -> None:
        check_cuda(self.cudart.cudaMemcpy2DAsync(dst + c.dst_offset, c.dst_pitch, src + c.src_offset, c.src_pitch,
                                                 c.width, c.height, self.d2d, self.stream))  # fmt: skip

    # rows.KVStore ----------------------------------------------------------------------------------------------
    def prefill(self, row, past_len, x, mask, positions):
        home = self._home(row)
        logits = self.decode(x, mask, positions, past_len, self._bind(home, past=True), self.present(0))
        total = self.layout.nbytes(1, past_len + x.shape[1])
        for dst, src in zip(home, self.batches[0]):
            check_cuda(self.cudart.cudaMemcpyAsync(dst.ptr, src.ptr, total, self.d2d, self.stream))
        return logits

    def gather(self, rows, lengths):
        longest = max(lengths)
        self.layout.check(lengths, longest)
        self.live = 0
        copies = self.layout.gather_copies(lengths)
        for t, dst in enumerate(self.batches[0]):
            check_cuda(self.cudart.cudaMemsetAsync(dst.ptr, 0, self.layout.nbytes(len(rows), longest), self.stream))
            for row, c in zip(rows, copies):
                self._copy(dst.ptr, self.homes[row][t].ptr, c)

    def step(self, past_len, x, mask, positions):
        logits = self.decode(x, mask, positions, past_len, self.past(self.live), self.present(1 - self.live))
        self.live = 1 - self.live
        return logits

    def scatter(self, rows, lengths, longest):
        self.layout.check(lengths, longest)
        copies = self.layout.scatter_copies(lengths, longest)
        for t, src in enumerate(self.batches[self.live]):
            for row, c in zip(rows, copies):
                self._copy(self.homes[row][t].ptr, src.ptr, c)

    def forget(self, row):
        """The home stays allocated for the next request given this row (the engine reuses the lowest rows)."""

    # engine check and shutdown ---------------------------------------------------------------------------------
    def to_host(self, batch: int, rows: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """A batch buffer's (rows, kv_heads, length, head_dim) cache copied out (`edgekit engine check`)."""
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        shape = (rows, self.layout.kv_heads, length, self.layout.head_dim)
        out = []
        for layer in range(self.layout.num_layers):
            pair = []
            for buf in self.batches[batch][2 * layer : 2 * layer + 2]:
                a = np.empty(shape, np.float32)
                check_cuda(self.cudart.cudaMemcpyAsync(a.ctypes.data, buf.ptr, a.nbytes, kind, self.stream))
                pair.append(a)
            out.append((pair[0], pair[1]))
        check_cuda(self.cudart.cudaStreamSynchronize(self.stream))
        return out

    def free(self) -> None:
        for buf in [*(b for batch in self.batches for b in batch), *(b for home in self.homes.values() for b in home)]:
            buf.free()
        self.homes.clear()
