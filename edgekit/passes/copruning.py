"""Co-pruning by joint weight-activation sensitivity, in 4x4 blocks cut at one global quantile.

The score of a weight is S = |dL/dw| * E|a| (the seed's co-pruning): how much the loss moves per unit of the
weight, times how large the input it multiplies usually is. The gradients need PyTorch and labelled data, which a
build does not have, so they come from a separate torch step (for the default model,
`python -m edgekit.models.radreport_tiny.sensitivity`, train extra) that writes a scores file; this pass only
reads it, and records the file's digest and the step's own metadata in its notes (so in the bundle's provenance).

`score = "activation"` is the gradient-free comparison from the same file, |w| * E|a| (Wanda's score);
`score = "magnitude"` needs no file, |w|. Blocks are 4x4 tiles of the (K, N) weight (what the X1's and most
NPUs' sparse GEMMs skip), scored by their mean S. One global quantile `tau` over every selected block decides
what goes, with a per-layer floor: a layer keeps at least `min_keep` of its blocks, so a global cut cannot wipe
out a small layer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgekit.names import DECODER

from .base import GraphPass, PassChanges, PassContext, PassPreconditionError
from .config import PassConfig, param
from .sparsity import select_weights, sparsity, sparsity_notes, write_kn

GRAD_SUFFIX, ACT_SUFFIX = ".grad_abs", ".act_abs"  # scores-file keys: MODULE.grad_abs (K, N), MODULE.act_abs (K,)


def block_scores(s: np.ndarray, block: int) -> np.ndarray:
    """(K, N) scores -> (ceil(K/b), ceil(N/b)) block means; edge blocks average what they cover."""
    k, n = s.shape
    kb, nb = -(-k // block), -(-n // block)
    padded = np.full((kb * block, nb * block), np.nan)
    padded[:k, :n] = s
    return np.nanmean(padded.reshape(kb, block, nb, block), axis=(1, 3))


def block_keep_masks(scores: list[np.ndarray], tau: float, min_keep: float) -> list[np.ndarray]:
    """Keep-masks over blocks: the lowest `tau` of all blocks pooled are cut (ties by position), then each layer
    gets back its best blocks until it keeps at least `min_keep` of them."""
    sizes = [b.size for b in scores]
    pooled = np.concatenate([b.ravel() for b in scores])
    keep = np.ones(pooled.size, bool)
    keep[np.argsort(pooled, kind="stable")[: int(round(tau * pooled.size))]] = False
    masks, start = [], 0
    for b, size in zip(scores, sizes):
        m = keep[start : start + size].copy()
        start += size
        floor = int(np.ceil(min_keep * size))
        if m.sum() < floor:
            m[np.argsort(-b.ravel(), kind="stable")[:floor]] = True
        masks.append(m.reshape(b.shape))
    return masks


def expand_blocks(mask: np.ndarray, block: int, shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(mask, block, 0), block, 1)[: shape[0], : shape[1]]


def read_scores(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The torch step's file: arrays by key and its metadata (JSON under the `edgekit` key)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            arrays = {k: f.get_tensor(k) for k in f.keys()}
            meta = json.loads((f.metadata() or {}).get("edgekit", "{}"))
    except (OSError, ValueError) as exc:
        raise PassPreconditionError(f"copruning: scores file {path} is unreadable ({exc})") from exc
    return arrays, meta


@dataclass
class CoPruneConfig(PassConfig):
    tau: float = param(0.2, min=0.0, max=0.9, help="global quantile of blocks cut (the seed: 0.1 to 0.3)")
    block: int = param(4, min=1, help="square block size along K and N")
    min_keep: float = param(0.28, min=0.0, max=1.0, help="blocks every layer keeps (the seed's Linear ratio)")
    score: str = param(
        "gradient",
        choices=("gradient", "activation", "magnitude"),
        help="gradient: |dL/dw| E|a|; activation: |w| E|a| (gradient-free); magnitude: |w|",
    )
    scores: str = param("", help="scores file from the torch sensitivity step (gradient and activation need it)")
    include: list[str] = param(["*"], help="module-name patterns to prune (fnmatch)")
    exclude: list[str] = param(["lm_head"], help="module-name patterns to leave dense")


class CoPrunePass(GraphPass):
    """Block pruning of the decoder's weight MatMuls by joint sensitivity (see the module docstring)."""

    name = "copruning"
    Config = CoPruneConfig
    config: CoPruneConfig  # what GraphPass.__init__ checks it is
    graphs = (DECODER,)

    def _scores(self) -> tuple[dict[str, np.ndarray], dict, str]:
        c = self.config
        if c.score == "magnitude":
            return {}, {}, ""
        if not c.scores:
            raise PassPreconditionError(
                f"copruning: score={c.score} needs a scores file (scores=PATH), written by the model's torch "
                "sensitivity step (for radreport-tiny: python -m edgekit.models.radreport_tiny.sensitivity)"
            )
        path = Path(c.scores)
        if not path.is_file():
            raise PassPreconditionError(f"copruning: scores file {path} not found")
        arrays, meta = read_scores(path)
        return arrays, meta, hashlib.sha256(path.read_bytes()).hexdigest()

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        c = self.config
        mms = select_weights(model, c.include, c.exclude, self.name)
        arrays, _, _ = self._scores()
        if c.score == "magnitude":
            return
        for mm in mms:
            key = mm.name + ACT_SUFFIX
            if key not in arrays or (c.score == "gradient" and mm.name + GRAD_SUFFIX not in arrays):
                raise PassPreconditionError(f"copruning: the scores file has no entry for {mm.name}")
            k, n = mm.kn().shape
            if arrays[key].shape != (k,) or (c.score == "gradient" and arrays[mm.name + GRAD_SUFFIX].shape != (k, n)):
                raise PassPreconditionError(f"copruning: scores for {mm.name} do not match its weight ({k}, {n})")

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        c = self.config
        mms = select_weights(model, c.include, c.exclude, self.name)
        arrays, meta, digest = self._scores()
        weights = [mm.kn() for mm in mms]
        scores = []
        for mm, w in zip(mms, weights):
            if c.score == "magnitude":
                s = np.abs(w)
            else:
                act = arrays[mm.name + ACT_SUFFIX].astype(np.float64)[:, None]
                s = (arrays[mm.name + GRAD_SUFFIX] if c.score == "gradient" else np.abs(w)) * act
            scores.append(block_scores(np.asarray(s, np.float64), c.block))
        masks = block_keep_masks(scores, c.tau, c.min_keep)
        reached, sizes = {}, {}
        for mm, w, m in zip(mms, weights, masks):
            pruned = np.where(expand_blocks(m, c.block, w.shape), w, np.float32(0))
            write_kn(mm, pruned)
            reached[mm.name], sizes[mm.name] = sparsity(pruned), pruned.size
        return PassChanges(
            initializers_touched=[mm.weight_name for mm in mms],
            notes={
                **sparsity_notes(reached, sizes),
                "weights_zeroed": int(sum(round(reached[k] * sizes[k]) for k in sizes)),
                "blocks": int(sum(m.size for m in masks)),
                "tau": c.tau,
                "block": c.block,
                "score": c.score,
                "scores_sha256": digest or None,
                "scores_step": meta or None,  # how the torch step made the gradients: split, studies, torch
            },
        )
