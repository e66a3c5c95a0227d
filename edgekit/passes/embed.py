"""`qembed`: the token-embedding table of `embed_tokens.onnx` stored as blocked INT4 (or INT8), one scale per
block of `block` hidden units of each row.

Why: once the decoder's MatMuls are INT4, the FP32 (vocab, hidden) table is one of the largest things left in an
INT4 bundle. The table is a `Gather`, not a MatMul, so the int4 pass does not see it. The same symmetric block
quantizer as INT4 (`int4_encode.quantize_blocks`) gives the integers; the weight format `format` writes them
(`weight_formats.py`, encoders in `embed_encode.py`):
- `gather-block-quantized` (4 bits; edgekit's default with no target, and the `cpu` target's): ONNX Runtime
  `com.microsoft.GatherBlockQuantized(int4 table, ids, scales)` gathers and dequantizes only the rows asked for,
  so no float copy of the table is ever made.
- `qdq-blocked` (orin, x1, and 8 bits): the standard-domain `DequantizeLinear(int table, scale, axis=1,
  block_size)` (opset 21) feeding the original `Gather`, which TensorRT 10 and any opset-21 runtime accept.
The graph keeps its interface: `input_ids` (int64) in, `inputs_embeds` (float32) out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from edgekit.ir_values import const_array, name_of
from edgekit.names import EMBED_TOKENS

from .base import GraphPass, PassChanges, PassContext, PassPreconditionError
from .config import PassConfig, param
from .embed_encode import EmbeddingGather, find_embedding_gathers
from .int4_encode import check_block, quantize_blocks
from .patterns import add_initializer, static_dim
from .weight_formats import EMBEDDING, WeightFormat, WritesWeightFormat

__all__ = ["EmbedQuantConfig", "EmbedQuantPass", "EmbeddingGather", "find_embedding_gathers"]

# the deprecated `encoding` parameter's values, as formats
ENCODING_FORMATS = {"gather": "gather-block-quantized", "dequantize": "qdq-blocked"}


@dataclass
class EmbedQuantConfig(WritesWeightFormat, PassConfig):
    format_uses = (EMBEDDING,)

    bits: int = param(4, choices=(4, 8), help="bits per table entry")
    block: int = param(32, choices=(16, 32, 64, 128), help="block size along the hidden axis")
    clip: int = param(0, min=0, max=50, help="range-shrink search steps per block (0: plain round to nearest)")
    format: str | None = param(
        None,
        help="weight format: gather-block-quantized (ONNX Runtime's GatherBlockQuantized, 4 bits), qdq-blocked "
        "(DequantizeLinear + Gather), or one a target registers; unset: the build target's first that fits, else "
        "gather-block-quantized at 4 bits and qdq-blocked at 8",
    )
    target: str | None = param(
        None, help="deprecated: the format this target takes (cpu: gather-block-quantized at 4 bits); use format"
    )
    encoding: str | None = param(
        None,
        choices=("auto", *ENCODING_FORMATS),
        help="deprecated: gather = format=gather-block-quantized, dequantize = format=qdq-blocked, auto = unset",
    )

    def validate(self, where: str) -> None:
        if self.encoding is not None:  # normalised into `format`, so the report and a rebuild see one choice
            named = ENCODING_FORMATS.get(self.encoding)
            warnings.warn(
                f"{where}.encoding is deprecated: use format={named}"
                if named
                else f"{where}.encoding=auto is deprecated: leave format unset",
                FutureWarning,
                stacklevel=3,
            )
            self.format = self.format or named
            self.encoding = None
        self.check_format(where)

    def format_bits(self) -> set[int]:
        return {self.bits}


class EmbedQuantPass(GraphPass):
    name = "qembed"
    Config = EmbedQuantConfig
    config: EmbedQuantConfig  # what GraphPass.__init__ checks it is
    graphs = (EMBED_TOKENS,)

    @property
    def format(self) -> WeightFormat:
        return self.config.weight_format()

    def preconditions(self, model: ir.Model, ctx: PassContext) -> None:
        found = find_embedding_gathers(model)
        if not found:
            raise PassPreconditionError(
                f"{self.name}: no Gather of a float (vocab, hidden) table to quantize in {ctx.graph}", ctx.graph or None
            )
        for g in found:
            check_block(static_dim(g.table, 1), self.config.block, name_of(g.table))

    def transform(self, model: ir.Model, ctx: PassContext) -> PassChanges:
        cfg = self.config
        fmt = self.format
        encode = fmt.encode_embedding
        assert encode is not None  # EmbedQuantConfig refuses a format that stores no tables
        changes = PassChanges()
        for g in find_embedding_gathers(model):
            table_name = name_of(g.table)  # an initializer's
            float_dtype = const_array(g.table).dtype  # the output keeps it (float32, or float16 after fp16)
            table = const_array(g.table).astype(np.float32)
            qw = quantize_blocks(table, cfg.block, bits=cfg.bits, symmetric=True, clip_grid=cfg.clip, name=table_name)
            signed = (qw.q.astype(np.int16) - 2 ** (cfg.bits - 1)).astype(ml_dtypes.int4 if cfg.bits == 4 else np.int8)
            base = table_name[: -len(".weight")] if table_name.endswith(".weight") else table_name
            codes = add_initializer(model.graph, signed, f"{base}.qweight")
            scales = add_initializer(model.graph, qw.scales.astype(float_dtype), f"{base}.scales")
            added, removed = encode(model, g, codes, scales, cfg.block)
            changes.nodes_added += added
            changes.nodes_removed += removed
            changes.initializers_touched.append(table_name)
            if not g.table.uses() and not g.table.is_graph_output():
                model.graph.initializers.pop(table_name, None)
            err = np.abs(qw.dequantize() - table)
            changes.notes.setdefault("tables", {})[table_name] = {
                "shape": list(table.shape),
                "max_abs_error": float(err.max()),
                "rel_l2": float(np.linalg.norm(err) / (np.linalg.norm(table) + 1e-12)),
            }
        changes.notes.update(
            {
                "format": fmt.name,
                "encoding": fmt.report_label(cfg.bits),
                "bits": cfg.bits,
                "block": cfg.block,
            }
        )
        return changes
