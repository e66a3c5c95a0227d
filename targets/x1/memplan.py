"""SRAM planning by tensor lifetimes: which activation lives where in the activation banks, and what must be tiled.

Why lifetimes: the activation banks hold 8 MiB, far less than the sum of every intermediate of a graph, but only a
few tensors are live at once. Each tensor gets a byte range in ACT from its first write to its last read (first
fit over the ranges of overlapping lifetimes); one too big for the banks at the nominal shape is placed in DRAM and
marked `tiled` (streamed through the banks in tiles by its consumer). Symbolic dims are sized at nominal values
(batch 1, sequences `plan_seq`): the plan is a budget, checked again at run time by the emulator's shapes.
"""

from __future__ import annotations

import numpy as np

ALIGN = 64


def nominal_bytes(shape: list | None, dtype_bytes: int, plan_seq: int) -> int:
    if shape is None:
        return 0
    n = 1
    for d in shape:
        if isinstance(d, int) and d > 0:
            n *= d
        elif isinstance(d, str) and "batch" in d:
            n *= 1
        else:
            n *= plan_seq
    return int(n * dtype_bytes)


def plan_memory(tensors: list[dict], uses: dict[int, tuple[int, int]], capacity: int) -> dict:
    """`tensors[i]` has `bytes`; `uses[i]` = (first, last) instruction index. Returns the plan section."""
    placed: list[tuple[int, int, int, int]] = []  # (first, last, offset, end)
    entries, peak = [], 0
    order = sorted(range(len(tensors)), key=lambda i: (uses.get(i, (0, 0))[0], -tensors[i]["bytes"]))
    result: dict[int, dict] = {}
    for i in order:
        t = tensors[i]
        first, last = uses.get(i, (0, 0))
        size = -(-t["bytes"] // ALIGN) * ALIGN
        if t.get("resident") or size == 0:
            result[i] = {
                **t,
                "space": "ACT" if not t.get("resident") else t.get("space", "NMW"),
                "offset": 0,
                "first": first,
                "last": last,
                "tiled": False,
            }
            continue
        if size > capacity:
            result[i] = {**t, "space": "DRAM", "offset": 0, "first": first, "last": last, "tiled": True}
            continue
        live = sorted((o, e) for f, l, o, e in placed if not (l < first or f > last))
        offset = 0
        for o, e in live:
            if offset + size <= o:
                break
            offset = max(offset, e)
        if offset + size > capacity:
            result[i] = {**t, "space": "DRAM", "offset": 0, "first": first, "last": last, "tiled": True}
            continue
        placed.append((first, last, offset, offset + size))
        peak = max(peak, offset + size)
        result[i] = {**t, "space": "ACT", "offset": offset, "first": first, "last": last, "tiled": False}
    entries = [result[i] for i in range(len(tensors))]
    naive = int(np.sum([t["bytes"] for t in tensors if not t.get("resident")]))
    return {
        "tensors": entries,
        "act_capacity_bytes": int(capacity),
        "act_peak_bytes": int(peak),
        "sum_of_tensor_bytes": naive,
        "tiled": sum(1 for e in entries if e["tiled"]),
    }
