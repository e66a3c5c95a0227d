"""The emulated KV cache: INT4 codes and FP16 group scales per layer, a resident SRAM window and a DRAM spill.

Why its own module: the cache is state that outlives a call (a generation hands it from step to step), with
its own invariants (rows a state can see are never rewritten), while everything else in the emulator is bound
once per program and stateless between calls.
"""

from __future__ import annotations

import numpy as np

from .kernels import dequantize_groups, native, quantize_groups_int4_f32, quantize_groups_int4_in_place
from .machine import Machine


class _KVRows:
    """One layer's KV rows in growable buffers, oldest first: INT4 codes and FP16 group scales for K and V held in
    float32 (the same values exactly), and V dequantised once on append.

    Why: attention reads the whole cache every token; keeping it in the form the kernels consume means a decode
    step converts only its new rows, and appending writes into spare capacity instead of re-concatenating the
    cache. `fill` is how many rows hold data: a `KVCache` of length `fill` may append in place; a shorter one
    (an earlier state a caller went back to) copies its rows into new buffers first, so every state stays valid.
    Appending to one state from two threads at once is not supported (one generation per thread is)."""

    __slots__ = ("codes", "scales", "v", "fill")

    def __init__(self, batch: int, heads: int, dim: int, groups: int, capacity: int):
        self.codes = np.empty((2, batch, heads, capacity, dim), np.float32)  # [K, V] INT4 codes
        self.scales = np.empty((2, batch, heads, capacity, groups), np.float32)  # [K, V] FP16 group scales
        self.v = np.empty((batch, heads, capacity, dim), np.float32)  # V codes x scales
        self.fill = 0

    @property
    def capacity(self) -> int:
        return self.codes.shape[3]

    def copy_rows(self, length: int, capacity: int) -> _KVRows:
        _, b, h, _, d = self.codes.shape
        new = _KVRows(b, h, d, self.scales.shape[-1], capacity)
        new.codes[:, :, :, :length] = self.codes[:, :, :, :length]
        new.scales[:, :, :, :length] = self.scales[:, :, :, :length]
        new.v[:, :, :length] = self.v[:, :, :length]
        new.fill = length
        return new


class KVCache:
    """Per layer: the cached positions in order, the newest `window` of them resident in SRAM and the older ones
    spilled to DRAM (kv-spill.md), all INT4 + FP16 scales. Immutable to its holders: `append` is only called on
    the emulator's own `copy()`, and rows a state can see are never rewritten (see `_KVRows`)."""

    _MIN_CAPACITY = 64

    def __init__(self, layers: int, window: int, group: int):
        self.window, self.group = window, group
        self.rows: list[_KVRows | None] = [None] * layers
        self.lengths = [0] * layers

    def copy(self) -> KVCache:
        c = KVCache.__new__(KVCache)
        c.window, c.group = self.window, self.group
        c.rows, c.lengths = list(self.rows), list(self.lengths)
        return c

    def length(self, layer: int) -> tuple[int, int]:
        """(resident, spilled) positions: the resident ring holds the newest `window`."""
        t = self.lengths[layer]
        r = min(t, self.window)
        return r, t - r

    def batch(self, layer: int) -> int:
        rows = self.rows[layer]
        return 0 if rows is None else rows.codes.shape[1]

    def _filled(self, layer: int) -> tuple[_KVRows, int]:
        """The layer's rows and how many of them hold data; an error before anything was appended to it."""
        rows = self.rows[layer]
        if rows is None:
            raise ValueError(f"KV cache layer {layer}: nothing appended yet")
        return rows, self.lengths[layer]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Quantise K and V (one call over both, in place in the store's new rows) after the layer's current
        positions."""
        n, t = k.shape[2], self.lengths[layer]
        if n == 0:
            return  # nothing to append (and an empty array shares no memory for the in-place kernel to use)
        rows = self.rows[layer]
        if rows is None or rows.fill != t or rows.capacity < t + n or rows.codes.shape[1:3] != k.shape[:2]:
            cap = max(self._MIN_CAPACITY, 2 * (t + n))
            if rows is None or t == 0 or rows.codes.shape[1:3] != k.shape[:2]:
                rows = _KVRows(k.shape[0], k.shape[1], k.shape[3], k.shape[3] // self.group, cap)
            else:
                rows = rows.copy_rows(t, cap)
            self.rows[layer] = rows
        end = t + n
        new = np.empty((2, *k.shape), np.float32)  # contiguous: a strided slice of the store is slower to work in
        new[0], new[1] = k, v
        if native.enabled:  # the same quantisation in C, written straight into the store's rows
            native.lib.kv_append(new, rows.codes, rows.scales, rows.v, t, self.group)
            rows.fill = self.lengths[layer] = end
            return
        s = quantize_groups_int4_in_place(new, self.group)  # (2, b, kv, n, G); `new` now holds the codes
        if s is None:  # `new` is fresh contiguous float32, so never; the copying form gives the same codes
            new, s = quantize_groups_int4_f32(new, self.group)
        rows.codes[:, :, :, t:end] = new
        rows.scales[:, :, :, t:end] = s
        vq = new[1]  # dequantised as `dequantize_groups` does: codes x scale per group
        rows.v[:, :, t:end] = (vq.reshape(*vq.shape[:-1], s.shape[-1], -1) * s[1][..., None]).reshape(vq.shape)
        rows.fill = self.lengths[layer] = end

    def keys(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K codes (b, kv, T, hd) and scales (b, kv, T, G), float32 views of all positions in order."""
        rows, t = self._filled(layer)
        return rows.codes[0, :, :, :t], rows.scales[0, :, :, :t]

    def key_store(self, layer: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Batch item 0's whole K store for the C attention kernel: codes (kv, capacity, hd), scales
        (kv, capacity) (one scale group per row) and how many rows hold data; None for other layouts."""
        rows = self.rows[layer]
        if rows is None or rows.codes.shape[1] != 1 or rows.scales.shape[-1] != 1:
            return None
        return rows.codes[0, 0], rows.scales[0, 0, :, :, 0], self.lengths[layer]

    def values(self, layer: int) -> np.ndarray:
        """Dequantised V (b, kv, T, hd): what XL_VMATMUL_PV reads."""
        rows, t = self._filled(layer)
        return rows.v[:, :, :t]

    def full(self, layer: int) -> list[np.ndarray]:
        """[K codes int8, K scales float16, V codes int8, V scales float16], (b, kv, T, hd | G), in position order."""
        rows, t = self._filled(layer)
        c, s = rows.codes[:, :, :, :t], rows.scales[:, :, :, :t]
        return [c[0].astype(np.int8), s[0].astype(np.float16), c[1].astype(np.int8), s[1].astype(np.float16)]

    def dequantized(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        kq, ks, vq, vs = self.full(layer)
        return dequantize_groups(kq, ks, self.group), dequantize_groups(vq, vs, self.group)

    @classmethod
    def from_arrays(cls, past: list[tuple[np.ndarray, np.ndarray]], window: int, group: int) -> KVCache:
        c = cls(len(past), window, group)
        for i, (k, v) in enumerate(past):
            if k.shape[2]:
                c.append(i, np.asarray(k, np.float32), np.asarray(v, np.float32))
        return c


def kv_window(machine: Machine, layers: int, kv_heads: int, head_dim: int) -> tuple[int, float]:
    """kv-spill.md: window = floor(per-layer KV bytes / per-layer bytes per token)."""
    per_token = 2 * kv_heads * head_dim * machine.kv_bits / 8
    return int(machine.kv_sram_bytes // layers // per_token), per_token
