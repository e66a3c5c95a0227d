"""Inputs for calibration-aware passes and for the numerical check.

Three sources, most to least realistic:
- `record_decoder_feeds(model_dir, n)`: the decoder's real prefill inputs, recorded from the `cpu` backend
  running synthetic studies of the train split (image features + prompt embeddings, as the reporter builds them).
- `sample_feeds(model, n, embeddings=...)`: random feeds in the graph's own input signature; for the decoder the
  `inputs_embeds` are rows of the real embedding table (random token ids), which is what activations look like.
- the same without an embedding table: Gaussian embeddings (fine for a smoke check, weak for calibration).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from edgekit.errors import ConfigError

from .base import EMBED_TOKENS

_DIM_DEFAULTS = {"batch": 1, "frames": 8}


def embedding_table(model_dir: str | Path | None) -> np.ndarray | None:
    """The (vocab, hidden) float32 table of `embed_tokens.onnx` in `model_dir`, if there is one.

    A plain `Gather` of a float initializer is read directly; a table that `qembed` stored quantised (INT4/INT8
    codes and scales, through `GatherBlockQuantized` or `DequantizeLinear`) is what the graph computes, so the
    graph is run in ONNX Runtime for every token id (reading its first 2-D initializer would return codes)."""
    if model_dir is None or not (Path(model_dir) / EMBED_TOKENS).is_file():
        return None
    path = Path(model_dir) / EMBED_TOKENS
    model = ir.load(path)
    for node in model.graph:
        table = node.inputs[0] if node.op_type == "Gather" and node.inputs else None
        if table is not None and table.const_value is not None and table.dtype in (
                ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE):
            return table.const_value.numpy().astype(np.float32)
    shapes = [v.shape for v in model.graph.initializers.values() if v.shape is not None and len(v.shape) == 2]
    if not shapes or [i.name for i in model.graph.inputs] != ["input_ids"]:
        return None
    vocab = int(shapes[0][0])  # codes (vocab, hidden or hidden / 2) and scales (vocab, blocks) agree on it
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"input_ids": np.arange(vocab, dtype=np.int64)[None]})[0][0], np.float32)


def _np_dtype(dtype: ir.DataType):
    return dtype.numpy() if dtype is not None else np.float32


def sample_feeds(model: ir.Model, n: int = 4, *, seq: int = 16, past: int = 0, seed: int = 0,
                 embeddings: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """`n` random feed dicts in `model`'s input signature. Symbolic dims: batch 1, seq `seq`, past `past`
    (every other sample uses a past of 4 so the KV-cache path is exercised too), total = past + seq."""
    rng = np.random.default_rng(seed)
    feeds = []
    for i in range(n):
        p = past if past or i % 2 == 0 else 4
        dims = {**_DIM_DEFAULTS, "seq": seq, "past_seq": p, "total_seq": p + seq}
        feed: dict[str, np.ndarray] = {}
        for value in model.graph.inputs:
            shape = [d if isinstance(d, int) else dims.get(str(d), 1) for d in (value.shape or [])]
            name, dtype = value.name, _np_dtype(value.dtype)
            if name == "attention_mask":
                feed[name] = np.ones(shape, dtype)
            elif name == "position_ids":
                feed[name] = np.broadcast_to(np.arange(p, p + shape[-1]), shape).astype(dtype)
            elif name == "input_ids":
                vocab = embeddings.shape[0] if embeddings is not None else 100
                feed[name] = rng.integers(0, vocab, shape).astype(dtype)
            elif name == "inputs_embeds" and embeddings is not None:
                ids = rng.integers(0, embeddings.shape[0], shape[:-1])
                feed[name] = embeddings[ids].astype(dtype)
            elif np.issubdtype(dtype, np.integer):
                feed[name] = np.zeros(shape, dtype)
            else:
                feed[name] = rng.standard_normal(shape).astype(dtype)
        feeds.append(feed)
    return feeds


def capture_values(model: ir.Model, names: Sequence[str], feeds: Sequence[dict[str, np.ndarray]]
                   ) -> dict[str, np.ndarray]:
    """The values named `names` (e.g. each weight MatMul's activation input) on every feed, flattened to
    (tokens, features) and concatenated across feeds. The model is not modified."""
    proto = ir.to_proto(model)
    existing = {o.name for o in proto.graph.output}
    for name in names:
        if name not in existing:
            proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every named value
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    chunks: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in feeds:
        outs = sess.run(list(names), {k: v for k, v in feed.items() if k in wanted})
        for name, arr in zip(names, outs):
            chunks[name].append(arr.reshape(-1, arr.shape[-1]).astype(np.float32))
    return {n: np.concatenate(c) for n, c in chunks.items()}


def record_decoder_feeds(model_dir: str | Path, n: int = 8, *, split: str = "train", start: int = 0,
                         prompt: str = "") -> list[dict[str, np.ndarray]]:
    """Real prefill feeds for the decoder: synthetic studies of `split` through the `cpu` backend's vision
    encoder and embeddings, arranged as the reporter does (`[image tokens] <bos> {modality}: {prompt} <sep>`)."""
    from edgekit.ingest.pixels import to_display
    from edgekit.models.synth import generate_study
    from edgekit.preprocess import PreprocessConfig, preprocess_frames
    from edgekit.targets.cpu import CpuBackend

    model_dir = Path(model_dir)
    backend = CpuBackend.from_dir(model_dir, intra_op_threads=1)
    tokenizer = _tokenizer(model_dir)
    cfg = PreprocessConfig()
    feeds = []
    for i in range(start, start + n):
        s = generate_study(i, split)
        frames = to_display(s.stored, slope=s.slope, intercept=s.intercept, center=s.center, width=s.width,
                            photometric=s.photometric)
        pixels = preprocess_frames(frames, cfg)[None]
        image = backend.encode_images(pixels)
        text = f"{s.modality}: {prompt}"
        ids = [1] + (tokenizer.encode(text).ids if tokenizer is not None else []) + [3]
        embeds = backend.embed(np.asarray([ids], np.int64))
        x = np.concatenate([image, embeds], axis=1).astype(np.float32)
        seq = x.shape[1]
        feed = {"inputs_embeds": x, "attention_mask": np.ones((1, seq), np.int64),
                "position_ids": np.arange(seq, dtype=np.int64)[None]}
        for layer, (k, v) in enumerate(backend.empty_past(1)):
            feed[f"past_key_values.{layer}.key"] = k
            feed[f"past_key_values.{layer}.value"] = v
        feeds.append(feed)
    return feeds


def _tokenizer(model_dir: Path):
    """`tokenizer.json` beside the graphs, else the committed one; None means prompt-free feeds."""
    from tokenizers import Tokenizer

    for cand in (model_dir / "tokenizer.json",
                 Path(__file__).resolve().parents[2] / "models/radreport_tiny/weights/tokenizer.json"):
        if cand.is_file():
            try:
                return Tokenizer.from_file(str(cand))
            except Exception as exc:  # a corrupt tokenizer is a user file problem
                raise ConfigError(f"cannot read tokenizer ({type(exc).__name__})", cand) from exc
    return None
