"""Head gates learned in training: one sigmoid gate per (decoder layer, attention head), model-agnostic.

A gate g[l, h] = sigmoid(logit) scales head h's attention output before o_proj. An L1 penalty on the open gates
pulls the heads the task needs least towards zero while the loss holds up the ones it needs; between `start` and
`end` of training the lowest gates are closed (exactly 0) one at a time, globally, until `rate` of all heads are
shut, and the rest of training teaches the model to do without them. The X1's DSS then ranks the closed heads
first (`g[l,h]` in docs/x1/dss.md) and skips them for free.

Shared by the embedded model's recipe (`models/radreport_tiny/head_gates.py` applies them its own way) and by the
fine-tuning of users' Hugging Face models (`edgekit.finetune.hf_gates` hooks them onto `o_proj`).
"""

from __future__ import annotations

import torch
from torch import nn


class HeadGates(nn.Module):
    closed: torch.Tensor  # a registered buffer, (layers, heads) bool: saved with the gates and moved with them

    def __init__(self, layers: int, heads: int, *, init_logit: float = 2.0):
        super().__init__()
        self.logits = nn.Parameter(torch.full((layers, heads), float(init_logit)))
        self.register_buffer("closed", torch.zeros(layers, heads, dtype=torch.bool))

    def values(self) -> torch.Tensor:
        """(layers, heads) gate values in [0, 1]; closed heads exactly 0."""
        return torch.sigmoid(self.logits).masked_fill(self.closed, 0.0)

    def penalty(self) -> torch.Tensor:
        """Mean value of the open gates: what the L1 sparsity term pushes down."""
        open_ = ~self.closed
        return self.values()[open_].mean() if open_.any() else self.logits.sum() * 0.0

    @torch.no_grad()
    def close_to(self, count: int, min_open_per_layer: int = 1) -> list[tuple[int, int]]:
        """Close the lowest open gates (globally; ties: lower layer, then head) until `count` are closed, never
        leaving a layer with fewer than `min_open_per_layer` open. Returns the (layer, head) pairs closed now."""
        g = torch.sigmoid(self.logits)
        newly = []
        order = sorted((float(g[li, h]), li, h) for li in range(g.shape[0]) for h in range(g.shape[1]))
        for _v, li, h in order:
            if int(self.closed.sum()) >= count:
                break
            if self.closed[li, h] or int((~self.closed[li]).sum()) <= min_open_per_layer:
                continue
            self.closed[li, h] = True
            newly.append((li, h))
        return newly

    @torch.no_grad()
    def layer_entries(self, modules: list[str], head_dim: int) -> list[dict]:
        """The gates as `head_importance.json` layer entries (schema of edgekit/passes/heads.py, version 1)."""
        g = self.values()
        return [
            {
                "layer": i,
                "module": modules[i],
                "heads": int(g.shape[1]),
                "head_dim": int(head_dim),
                "score": [float(x) for x in g[i]],
                "closed": [int(h) for h in torch.nonzero(self.closed[i]).flatten()],
            }
            for i in range(g.shape[0])
        ]


def closed_target(step: int, total_steps: int, heads_total: int, rate: float, start: float, end: float) -> int:
    """How many heads should be closed after `step` of `total_steps`: 0 before `start`, `rate` of all heads from
    `end` on, linear in between (one head at a time)."""
    t = (step + 1) / total_steps
    k = int(round(rate * heads_total))
    if t < start:
        return 0
    if t >= end:
        return k
    return int(k * (t - start) / (end - start))
