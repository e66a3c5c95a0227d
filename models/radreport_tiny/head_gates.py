"""Head gates learned at training time: the model side of the X1's dynamic head skipping (DSS).

The gates and their closing schedule are the core's (`edgekit.finetune.gates`, also used to fine-tune users'
Hugging Face models); here they are applied the way radreport-tiny's attention takes them (`attn.head_gate`).

What is exported: nothing new in the graphs. `fold_into` multiplies each head's o_proj columns by its gate, so a
closed head adds exactly zero to the residual stream, and `importance_doc` writes the gates as the bundle's
`head_importance.json` (`g[l,h]` in docs/x1/dss.md): DSS then ranks the closed heads first and skips them for
free. Training-only, like the probes in train.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from edgekit.finetune.gates import HeadGates as CoreHeadGates
from edgekit.finetune.gates import closed_target

__all__ = ["METHOD", "HeadGates", "closed_target"]

METHOD = "learned sigmoid head gates (L1 penalty, the lowest closed to 0 during training), folded into o_proj"


class HeadGates(CoreHeadGates):
    """The core gates, applied and folded the way radreport-tiny's attention takes them."""

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
        c = model.config
        modules = [f"model.layers.{i}.self_attn" for i in range(self.logits.shape[0])]
        return {"version": 1, "method": METHOD, "layers": self.layer_entries(modules, c.head_dim)}
