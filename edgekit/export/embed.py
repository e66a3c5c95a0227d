"""`embed_tokens.onnx`: token ids -> embeddings, a graph of its own so the runtime can splice image features in
front of the prompt before the decoder runs (the Hugging Face VLM export convention)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from edgekit import names

from .irbuilder import GraphBuilder, scope_of
from .specs import DecoderSpec


def build_embed_tokens(weights: Mapping[str, np.ndarray], spec: DecoderSpec) -> ir.Model:
    b = GraphBuilder(weights, "embed_tokens")
    ids = b.input(names.INPUT_IDS, ir.DataType.INT64, ["batch", "seq"])
    table = b.weight(f"{spec.embed_tokens}.weight")
    out = b.op(scope_of(spec.embed_tokens), "Gather", [table, ids], {"axis": 0})
    b.output(out, names.INPUTS_EMBEDS, ir.DataType.FLOAT, ["batch", "seq", spec.hidden])
    return b.model()
