"""Cutting edgekit's square frame the way a VLM's processor tiles an image: exact crops, and the whole frame
downscaled to one crop's size. Shared by Idefics3's image splitting and LLaVA-NeXT's anyres grid.

Why a block mean by Reshape + ReduceMean rather than AveragePool: it is the same BOX downscale at an integer
factor, and every op here has an X1 instruction, so the vision program needs no host partition.
"""

from __future__ import annotations

import onnx_ir as ir

from edgekit.export.irbuilder import GraphBuilder


def crops_and_downscale(b: GraphBuilder, scope: str, x: ir.Value, r: int, m: int) -> tuple[ir.Value, ir.Value]:
    """(B, 1, r*m, r*m) -> the r x r crops row by row (B, r*r, m, m), and the frame averaged over r x r blocks
    (B, 1, m, m): Pillow's BOX at the integer factor r."""
    t = b.op(scope, "Reshape", [x, b.const([-1, r, m, r, m])])
    t = b.op(scope, "Transpose", [t], {"perm": [0, 1, 3, 2, 4]})
    crops = b.op(scope, "Reshape", [t, b.const([-1, r * r, m, m])])
    blocks = b.op(scope, "Reshape", [x, b.const([-1, m, r, m, r])])
    mean = b.op(scope, "ReduceMean", [blocks, b.const([2, 4])], {"keepdims": 0})
    return crops, b.op(scope, "Reshape", [mean, b.const([-1, 1, m, m])])
