"""Cutting edgekit's square frame the way a VLM's processor tiles an image: exact crops, and the whole frame
downscaled to one crop's size. Shared by Idefics3's image splitting (tiles, then the global image) and
LLaVA-NeXT's anyres grid (the base image, then the crops); the graph and the parity check's numpy copy are here
together so the two cannot drift.

Why a block mean by Reshape + ReduceMean rather than AveragePool: it is the same BOX downscale at an integer
factor, and every op here has an X1 instruction, so the vision program needs no host partition.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from edgekit.export.irbuilder import GraphBuilder


def split_frame(b: GraphBuilder, x: ir.Value, r: int, m: int, whole_first: bool) -> ir.Value:
    """(B, 1, r*m, r*m) display frame -> (B * (r*r + 1), 1, m, m) tower inputs: the r x r crops row by row (the
    processors' `unfold` / `divide_to_patches`) and the frame averaged over r x r blocks (Pillow's BOX at the
    integer factor r), before the crops when `whole_first`, else after them."""
    scope = "/image_processor/split"
    t = b.op(scope, "Reshape", [x, b.const([-1, r, m, r, m])])
    t = b.op(scope, "Transpose", [t], {"perm": [0, 1, 3, 2, 4]})
    crops = b.op(scope, "Reshape", [t, b.const([-1, r * r, m, m])])
    blocks = b.op(scope, "Reshape", [x, b.const([-1, m, r, m, r])])
    whole = b.op(scope, "ReduceMean", [blocks, b.const([2, 4])], {"keepdims": 0})
    whole = b.op(scope, "Reshape", [whole, b.const([-1, 1, m, m])])
    y = b.op(scope, "Concat", [whole, crops] if whole_first else [crops, whole], {"axis": 1})
    return b.op(scope, "Reshape", [y, b.const([-1, 1, m, m])])


def split_frame_np(gray: np.ndarray, r: int, m: int, whole_first: bool) -> np.ndarray:
    """`split_frame` for one (r*m, r*m) frame in numpy: (r*r + 1, m, m) float32."""
    crops = gray.reshape(r, m, r, m).transpose(0, 2, 1, 3).reshape(r * r, m, m)
    whole = gray.reshape(m, r, m, r).mean(axis=(1, 3), dtype=np.float32)[None]
    return np.concatenate([whole, crops] if whole_first else [crops, whole]).astype(np.float32)
