"""The cpu target's KV cache: one preallocated buffer per layer for keys and one for values, rows kept compact.

Each buffer is (rows, kv_heads, capacity, head_dim) float32, bound to the fused decoder as both its past and its
present (GroupQueryAttention writes a step's keys in place at each row's own length). The engine names rows by
small integers that come and go; here each lives in a *physical* row, and the physical rows in use are always
[0, count). Why compact: a decode step binds `buf[:n]`, a contiguous view, so the rows stepping together must be
physical rows 0 .. n-1. Keeping them there costs copies only when the set changes:

- a new row takes physical row `count`;
- a released row's hole is filled by the last physical row (its valid length copied once);
- a step whose rows are not exactly [0, n) (a row still prefilling sits among them) swaps rows until they are;
  the order within [0, n) does not matter: the backend permutes the step's inputs and logits instead.

Capacity (positions per row) starts small and doubles when a row needs more: new buffers, the valid part copied
once, and `generation` bumped so bindings to the old memory are dropped. np.zeros memory is committed by the OS
only when written, so a large `rows` costs address space, not RAM, until rows fill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgekit.errors import EdgekitError


class KvBuffers:
    """Keys and values of `layers` layers for up to `rows` rows; lengths and the row -> physical-row map."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int = 256):
        if rows < 1 or capacity < 1:
            raise EdgekitError(f"KV buffers need rows >= 1 and capacity >= 1, got {rows}, {capacity}")
        self.layers, self.rows, self.kv_heads, self.head_dim = layers, rows, kv_heads, head_dim
        self.capacity = capacity
        self.generation = 0  # bumped whenever the buffers move (capacity growth)
        self.keys, self.values = self._allocate(capacity)
        # valid positions per physical row: Python ints, not an array. A decode step reads and bumps them right
        # after the decoder's run, where one numpy call cost ~9 us (radreport-tiny: 6% of a token, py-spy)
        self.length = [0] * rows
        self._physical: dict[int, int] = {}  # engine row -> physical row
        self._owner: list[int | None] = [None] * rows  # physical row -> engine row

    def _allocate(self, capacity: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        shape = (self.rows, self.kv_heads, capacity, self.head_dim)
        return [np.zeros(shape, np.float32) for _ in range(self.layers)], [
            np.zeros(shape, np.float32) for _ in range(self.layers)
        ]

    @property
    def count(self) -> int:
        return len(self._physical)

    def __contains__(self, row: int) -> bool:
        return row in self._physical

    def physical(self, row: int) -> int:
        return self._physical[row]

    def length_of(self, row: int) -> int:
        return self.length[self._physical[row]]

    # rows coming and going ------------------------------------------------------------------------------------
    def acquire(self, row: int) -> int:
        """A physical row for a new engine row (empty cache)."""
        if row in self._physical:
            raise EdgekitError(f"row {row} already holds a cache")
        if self.count >= self.rows:
            raise EdgekitError(f"all {self.rows} KV rows are in use")
        p = self.count
        self._physical[row], self._owner[p] = p, row
        self.length[p] = 0
        return p

    def release(self, row: int) -> None:
        """Forget `row`; the last physical row moves into its place (its valid part copied)."""
        p = self._physical.pop(row, None)
        if p is None:
            return
        last = self.count  # the old count - 1
        if p != last:
            self._copy(last, p)
            moved = self._owner[last]
            assert moved is not None, f"physical row {last} below the count has no owner"
            self._physical[moved], self._owner[p] = p, moved
        self._owner[last] = None
        self.length[last] = 0

    def gather(self, rows: Sequence[int]) -> list[int]:
        """Swap physical rows until `rows` occupy [0, len(rows)); returns each row's physical index, in order."""
        n = len(rows)
        where = [self._physical[r] for r in rows]
        if max(where) >= n:  # steady decoding skips this: the rows stay where the last step put them
            wanted = set(rows)
            outsiders = [p for p in range(n) if self._owner[p] not in wanted]
            for r in rows:
                if self._physical[r] >= n:
                    self._swap(self._physical[r], outsiders.pop())
            where = [self._physical[r] for r in rows]
        return where

    def reserve(self, rows: Sequence[int], extra: int) -> None:
        """Capacity for `extra` more positions in each of `rows` (doubling, the valid part copied once)."""
        need = max(self.length[self._physical[r]] for r in rows) + extra
        if need <= self.capacity:
            return
        capacity = self.capacity
        while capacity < need:
            capacity *= 2
        keys, values = self._allocate(capacity)
        used, longest = self.count, max(self.length)
        for old, new in ((self.keys, keys), (self.values, values)):
            for a, b in zip(old, new):
                b[:used, :, :longest] = a[:used, :, :longest]
        self.keys, self.values, self.capacity = keys, values, capacity
        self.generation += 1

    def advance(self, physical: int, by: int = 1) -> None:
        """`by` more valid positions in one physical row."""
        self.length[physical] += by

    def advance_first(self, n: int) -> None:
        """One more valid position in each of physical rows [0, n) (a decode step's)."""
        length = self.length
        for p in range(n):
            length[p] += 1

    # copies -----------------------------------------------------------------------------------------------
    def _copy(self, src: int, dst: int) -> None:
        n = self.length[src]
        for buf in (*self.keys, *self.values):
            buf[dst, :, :n] = buf[src, :, :n]
        self.length[dst] = n

    def _swap(self, a: int, b: int) -> None:
        la, lb = self.length[a], self.length[b]
        for buf in (*self.keys, *self.values):
            held = buf[a, :, :la].copy()
            buf[a, :, :lb] = buf[b, :, :lb]
            buf[b, :, :la] = held
        self.length[a], self.length[b] = lb, la
        ra, rb = self._owner[a], self._owner[b]
        self._owner[a], self._owner[b] = rb, ra
        for row, p in ((rb, a), (ra, b)):
            if row is not None:
                self._physical[row] = p
