"""What radreport-tiny's training minimises: the report's cross-entropy, plus the training-only heads that give the
vision encoder a direct signal (the finding probe, the count-map probe) and the head gates' penalty. None of the
heads is exported; the gates are folded into `o_proj` when training ends (`head_gates.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgekit.export.model_config import ModelConfig

from .data import IGNORE
from .head_gates import HeadGates
from .modeling import RadReportTiny


class FindingProbe(nn.Module):
    """Training-only: a linear read-out of every (type, location) finding from the flattened image tokens.

    It gives the vision encoder a direct signal for what the report must say and where, instead of only the
    gradient that trickles back through the decoder's cross-attention to image tokens. With it, the 2-core
    training budget reaches the finding F1 the decoder alone did not (0.77 -> see training_log.json). It is
    not part of the exported model.
    """

    def __init__(self, cfg: ModelConfig, num_labels: int):
        super().__init__()
        self.proj = nn.Linear(cfg.num_image_tokens * cfg.hidden, num_labels)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.proj(image_features.flatten(1))


class CountMapProbe(nn.Module):
    """Training-only: from each image token alone, how many findings of each counted type and side (nodules in
    the left and in the right lung) are centred in that token's cell of the image.

    A study's count is otherwise taught by one label per study (a report word, three of the finding probe's
    labels), and the encoder did not learn to count small blobs from it: CT nodule counts were right in 16 of 28
    test studies, with every stage of the vision path equally poor at it under a linear read-out. Counting
    where each nodule is gives every cell its own target. It is not part of the exported model.
    """

    def __init__(self, cfg: ModelConfig, num_channels: int):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden, num_channels)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:  # (b, tokens, hidden) -> (b, channels, tokens)
        return self.proj(image_features).transpose(1, 2)

    def loss(self, image_features: torch.Tensor, count_maps: torch.Tensor) -> torch.Tensor:
        """Squared error summed over a study's channels and cells, mean over studies."""
        return (self(image_features) - count_maps).pow(2).sum((1, 2)).mean()


def training_loss(
    model: RadReportTiny,
    probe: FindingProbe | None,
    batch: dict[str, torch.Tensor],
    aux_weight: float,
    count_probe: CountMapProbe | None = None,
    count_map_weight: float = 0.0,
    gates: HeadGates | None = None,
    gate_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss, LM loss): report cross-entropy plus `aux_weight` x the probe's binary cross-entropy plus
    `count_map_weight` x the count-map probe's squared error (`CountMapProbe.loss`) plus `gate_weight` x the
    mean open head gate, with the decoder's heads scaled by `gates`."""
    if gates is not None:
        with gates.applied(model):
            total, lm = training_loss(model, probe, batch, aux_weight, count_probe, count_map_weight)
        return total + gate_weight * gates.penalty(), lm
    img = model.encode_images(batch["pixel_values"])
    x = torch.cat([img, model.model.embed_tokens(batch["input_ids"])], dim=1)
    mask = torch.cat(
        [torch.ones(x.shape[0], img.shape[1], dtype=batch["attention_mask"].dtype), batch["attention_mask"]], 1
    )
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model.decode(x, mask, pos)[0][:, img.shape[1] :]
    lm = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE
    )
    total = lm
    if probe is not None and aux_weight != 0:
        labels = batch["finding_labels"][:, : probe.proj.out_features]  # presence first, then count and size
        total = total + aux_weight * F.binary_cross_entropy_with_logits(probe(img), labels)
    if count_probe is not None and count_map_weight != 0:
        total = total + count_map_weight * count_probe.loss(img, batch["count_maps"])
    return total, lm


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the report tokens and <eos>: logits at t - 1 predict the label at t."""
    logits = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE
    )
