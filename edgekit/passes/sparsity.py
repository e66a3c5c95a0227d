"""Weight sparsity passes: unstructured magnitude pruning (`prune`) and 2:4 semi-structured (`sparse24`).

Both zero weights in place and keep every shape, so the graph, the KV cache and the other passes (INT4 after 2:4
is a supported recipe) are unchanged; what they buy is compressibility and, for 2:4, the Ampere/Orin sparse
tensor cores, which need exactly 2 non-zeros in every group of 4 consecutive elements along the reduction (K,
input) axis of the GEMM. Each reports the sparsity it actually reached per weight, since "50%" asked for is not
always what a layer gets (ties, weights that were already zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from edgekit.names import DECODER

from .base import GraphPass, PassChanges, PassContext, PassPreconditionError
from .config import PassConfig, param
from .patterns import WeightMatMul, matches_any, require_weight_matmuls


# --------------------------------------------------------------------------------------------------------------
# the numerics, on (K, N) arrays (the layout MatMul consumes: K is the input / reduction axis)
# --------------------------------------------------------------------------------------------------------------
def magnitude_mask(w: np.ndarray, n_zero: int) -> np.ndarray:
    """Keep-mask zeroing exactly the `n_zero` smallest |w| (ties broken by position, so it is deterministic)."""
    flat = np.abs(w).ravel()
    keep = np.ones(flat.size, bool)
    if n_zero > 0:
        keep[np.argsort(flat, kind="stable")[:n_zero]] = False
    return keep.reshape(w.shape)


def global_magnitude_masks(weights: list[np.ndarray], ratio: float) -> list[np.ndarray]:
    """One threshold over all weights: the smallest `ratio` of all |w| pooled, so layers differ in sparsity."""
    sizes = [w.size for w in weights]
    pooled = np.concatenate([np.abs(w).ravel() for w in weights])
    keep = np.ones(pooled.size, bool)
    keep[np.argsort(pooled, kind="stable")[: int(round(ratio * pooled.size))]] = False
    out, start = [], 0
    for w, n in zip(weights, sizes):
        out.append(keep[start : start + n].reshape(w.shape))
        start += n
    return out


def mask_2to4(w_kn: np.ndarray) -> np.ndarray:
    """Keep-mask with the 2 largest |w| of every 4 consecutive elements along K (axis 0 of a (K, N) weight)."""
    k, n = w_kn.shape
    if k % 4:
        raise ValueError(f"K={k} is not a multiple of 4")
    groups = np.abs(w_kn).reshape(k // 4, 4, n)
    order = np.argsort(-groups, axis=1, kind="stable")  # largest first; ties keep the earlier element
    keep = np.zeros_like(groups, dtype=bool)
    np.put_along_axis(keep, order[:, :2, :], True, axis=1)
    return keep.reshape(k, n)


def is_2to4(w_kn: np.ndarray) -> bool:
    """True when every group of 4 along K has at most 2 non-zeros (what the sparse tensor cores accept)."""
    k, n = w_kn.shape
    return k % 4 == 0 and bool(((w_kn.reshape(k // 4, 4, n) != 0).sum(axis=1) <= 2).all())


def sparsity(w: np.ndarray) -> float:
    return float((w == 0).mean()) if w.size else 0.0


# --------------------------------------------------------------------------------------------------------------
# graph side
# --------------------------------------------------------------------------------------------------------------
def select_weights(
    model: ir.Model, include: Sequence[str], exclude: Sequence[str], pass_name: str
) -> list[WeightMatMul]:
    """Weight MatMuls whose module name matches `include` and not `exclude` (fnmatch), one per initializer."""
    seen: set[str] = set()
    out: list[WeightMatMul] = []
    for mm in require_weight_matmuls(model, pass_name):
        if mm.weight_name in seen or not matches_any(mm.name, include) or matches_any(mm.name, exclude):
            continue
        seen.add(mm.weight_name)
        out.append(mm)
    if not out:
        raise PassPreconditionError(f"{pass_name}: no weight matches include={list(include)} exclude={list(exclude)}")
    return out


def write_kn(mm: WeightMatMul, w_kn: np.ndarray) -> None:
    """Store a (K, N) array back in the initializer's own layout."""
    stored = w_kn.T if mm.transpose is not None else w_kn
    mm.weight.const_value = ir.Tensor(np.ascontiguousarray(stored, dtype=np.float32), name=mm.weight.name)


def sparsity_notes(reached: dict[str, float], sizes: dict[str, int]) -> dict:
    total = sum(sizes.values())
    overall = sum(reached[k] * sizes[k] for k in reached) / total if total else 0.0
    return {"sparsity_per_layer": {k: round(v, 6) for k, v in reached.items()}, "sparsity_overall": round(overall, 6)}


_DEFAULT_EXCLUDE = ["lm_head"]  # the LM head is the most sensitive matmul; prune it only on request


@dataclass
class PruneConfig(PassConfig):
    ratio: float = param(0.5, min=0.0, max=0.99, help="fraction of each selected weight set to zero")
    scope: str = param(
        "layer",
        choices=("layer", "global"),
        help="layer: every weight reaches `ratio`; global: one magnitude threshold for all",
    )
    include: list[str] = param(["*"], help="module-name patterns to prune (fnmatch)")
    exclude: list[str] = param(list(_DEFAULT_EXCLUDE), help="module-name patterns to leave dense")


class PrunePass(GraphPass):
    """Unstructured magnitude pruning to a target ratio, per layer or with one global threshold."""

    name = "prune"
    Config = PruneConfig
    config: PruneConfig  # what GraphPass.__init__ checks it is
    graphs = (DECODER,)

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        select_weights(model, self.config.include, self.config.exclude, self.name)

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        c = self.config
        mms = select_weights(model, c.include, c.exclude, self.name)
        arrays = [mm.kn() for mm in mms]
        if c.scope == "global":
            masks = global_magnitude_masks(arrays, c.ratio)
        else:
            masks = [magnitude_mask(w, int(round(c.ratio * w.size))) for w in arrays]
        reached, sizes = {}, {}
        for mm, w, keep in zip(mms, arrays, masks):
            pruned = np.where(keep, w, np.float32(0))
            write_kn(mm, pruned)
            reached[mm.name], sizes[mm.name] = sparsity(pruned), pruned.size
        return PassChanges(
            initializers_touched=[mm.weight_name for mm in mms],
            notes={**sparsity_notes(reached, sizes), "target": c.ratio, "scope": c.scope},
        )


@dataclass
class Sparse24Config(PassConfig):
    include: list[str] = param(["*"], help="module-name patterns to make 2:4 sparse (fnmatch)")
    exclude: list[str] = param(list(_DEFAULT_EXCLUDE), help="module-name patterns to leave dense")


class Sparse24Pass(GraphPass):
    """2:4 semi-structured sparsity along K, the layout Ampere/Orin sparse tensor cores (TensorRT
    `SPARSE_WEIGHTS`, `trtexec --sparsity`) accept."""

    name = "sparse24"
    Config = Sparse24Config
    config: Sparse24Config  # what GraphPass.__init__ checks it is
    graphs = (DECODER,)

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        mms = select_weights(model, self.config.include, self.config.exclude, self.name)
        bad = [f"{mm.name} (K={mm.k})" for mm in mms if mm.k % 4]
        if bad:
            raise PassPreconditionError(
                f"{self.name}: the input dimension K must be a multiple of 4 for 2:4 "
                f"sparsity; not so for {', '.join(bad)} (exclude them to go on)"
            )

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        mms = select_weights(model, self.config.include, self.config.exclude, self.name)
        reached, sizes = {}, {}
        for mm in mms:
            w = mm.kn()
            pruned = np.where(mask_2to4(w), w, np.float32(0))
            write_kn(mm, pruned)
            reached[mm.name], sizes[mm.name] = sparsity(pruned), pruned.size
        return PassChanges(
            initializers_touched=[mm.weight_name for mm in mms],
            notes={**sparsity_notes(reached, sizes), "pattern": "2:4 along K"},
        )
