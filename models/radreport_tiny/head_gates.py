"""Head gates learned at training time: the model side of the X1's dynamic head skipping (DSS).

A gate g[l, h] = sigmoid(logit) scales each decoder attention head's output before o_proj. An L1 penalty on the
open gates pulls the heads the reports need least towards zero while the LM loss holds up the ones it needs;
between `close_start` and `close_end` of training the lowest gates are closed (set to exactly 0) one at a time,
globally, until `rate` of all heads are shut, and the rest of training teaches the model to do without them.

What is exported: nothing new in the graphs. `fold_into` multiplies each head's o_proj columns by its gate, so a
closed head adds exactly zero to the residual stream, and `importance_doc` writes the gates as the bundle's
`head_importance.json` (`g[l,h]` in docs/x1/dss.md): DSS then ranks the closed heads first and skips them for
free. Training-only, like the probes in train.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

METHOD = "learned sigmoid head gates (L1 penalty, the lowest closed to 0 during training), folded into o_proj"


class HeadGates(nn.Module):
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

    @contextmanager
    def applied(self, model):
        """Within the block, every decoder attention layer of `model` scales its heads by the gates."""
        attns = [layer.self_attn for layer in model.model.layers]
        g = self.values()
        try:
            for i, attn in enumerate(attns):
                attn.head_gate = g[i]
            yield
        finally:
            for attn in attns:
                attn.head_gate = None

    @torch.no_grad()
    def fold_into(self, model) -> None:
        """Scale each head's o_proj input columns by its gate, in place: the model then computes what it computed
        with the gates applied, with no gate in it (so the ONNX export needs no change)."""
        g = self.values()
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            hd = attn.c.head_dim
            w = attn.o_proj.weight  # (hidden, heads * head_dim)
            w.mul_(g[i].repeat_interleave(hd)[None, :])

    @torch.no_grad()
    def importance_doc(self, model) -> dict:
        """The gates as a `head_importance.json` document (schema of edgekit/passes/heads.py, version 1)."""
        g = self.values()
        c = model.config
        return {
            "version": 1,
            "method": METHOD,
            "layers": [
                {
                    "layer": i,
                    "module": f"model.layers.{i}.self_attn",
                    "heads": c.heads,
                    "head_dim": c.head_dim,
                    "score": [float(x) for x in g[i]],
                    "closed": [int(h) for h in torch.nonzero(self.closed[i]).flatten()],
                }
                for i in range(g.shape[0])
            ],
        }


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
