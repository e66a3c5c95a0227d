"""Inputs for calibration-aware passes and for the numerical check.

Four sources, most to least realistic:
- `record_decoder_feeds(model_dir, n)`: the decoder's real prefill inputs, recorded by running the model family's
  calibration studies through the vision encoder and embeddings (image features + prompt embeddings, as the
  reporter builds them).
- `vision_feeds(model, n)`: the same studies, preprocessed, as the vision encoder's `pixel_values`.
- `sample_feeds(model, n, embeddings=...)`: random feeds in the graph's own input signature; for the decoder the
  `inputs_embeds` are rows of the real embedding table (random token ids), which is what activations look like.
- the same without an embedding table: Gaussian embeddings (fine for a smoke check, weak for calibration).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.ir_values import name_of
from edgekit.plugins import DEFAULT_MODEL, get_model_family

_DIM_DEFAULTS = {"batch": 1, "frames": 8}


def embedding_table(model_dir: str | Path | None) -> np.ndarray | None:
    """The (vocab, hidden) float32 table of `embed_tokens.onnx` in `model_dir`, if there is one.

    A plain `Gather` of a float initializer is read directly; a table that `qembed` stored quantised (INT4/INT8
    codes and scales, through `GatherBlockQuantized` or `DequantizeLinear`) is what the graph computes, so the
    graph is run in ONNX Runtime for every token id (reading its first 2-D initializer would return codes)."""
    if model_dir is None or not (Path(model_dir) / names.EMBED_TOKENS).is_file():
        return None
    path = Path(model_dir) / names.EMBED_TOKENS
    model = ir.load(path)
    for node in model.graph:
        table = node.inputs[0] if node.op_type == "Gather" and node.inputs else None
        if (
            table is not None
            and table.const_value is not None
            and table.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
        ):
            return table.const_value.numpy().astype(np.float32)
    shapes = [v.shape for v in model.graph.initializers.values() if v.shape is not None and len(v.shape) == 2]
    if not shapes or [i.name for i in model.graph.inputs] != [names.INPUT_IDS]:
        return None
    vocab = shapes[0][0]  # codes (vocab, hidden or hidden / 2) and scales (vocab, blocks) agree on it
    if not isinstance(vocab, int):  # an initializer's dims are fixed; without that there is no row count to read
        return None
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {names.INPUT_IDS: np.arange(vocab, dtype=np.int64)[None]})[0][0], np.float32)


def _np_dtype(dtype: ir.DataType | None) -> np.dtype:
    return dtype.numpy() if dtype is not None else np.dtype(np.float32)


def dim_value(name: str, known: Mapping[str, int]) -> int:
    """The size given to a symbolic dimension: `known[name]` (edgekit's names and the user's overrides), else a
    guess from common exporters' names (torch.onnx, Optimum, tf2onnx): batch-like 1, past-like `past_seq`,
    total-like `total_seq`, sequence-like `seq`, `a + b` as the sum of its parts; anything else 1."""
    if name in known:
        return int(known[name])
    if "+" in name:
        parts = [p.strip() for p in name.split("+")]
        return sum(int(p) if p.isdigit() else dim_value(p, known) for p in parts)
    low = name.lower()
    if "past" in low or "cache" in low:
        return int(known.get("past_seq", 0))
    if "total" in low or "key_value" in low:
        return int(known.get("total_seq", known.get("seq", 16)))
    if "batch" in low or low in ("n", "b", "bs", "unk__0"):
        return int(known.get("batch", 1))
    if "seq" in low or "len" in low or "token" in low or low in ("s", "t", "time"):
        return int(known.get("seq", 16))
    return 1


def _gather_rows(model: ir.Model) -> dict[str, int | None]:
    """For each value a `Gather` indexes with, the rows of the table it reads (a vocabulary size for token ids;
    None when that dim is symbolic); the first such Gather in graph order counts. One scan of the graph."""
    rows: dict[str, int | None] = {}
    for node in model.graph:
        ids = node.inputs[1] if node.op_type == "Gather" and len(node.inputs) > 1 else None
        if ids is not None and ids.name is not None:  # feeds are by name: an unnamed value is no graph input
            table = node.inputs[0]
            if table is not None and table.shape is not None and table.shape.rank():
                n = table.shape[0]
                rows.setdefault(ids.name, n if isinstance(n, int) else None)
    return rows


def sample_feeds(
    model: ir.Model,
    n: int = 4,
    *,
    seq: int = 16,
    past: int = 0,
    seed: int = 0,
    embeddings: np.ndarray | None = None,
    dims: Mapping[str, int] | None = None,
) -> list[dict[str, np.ndarray]]:
    """`n` random feed dicts in `model`'s input signature. Symbolic dims: batch 1, seq `seq`, past `past`
    (every other sample uses a past of 4 so the KV-cache path is exercised too), total = past + seq; other
    names by `dim_value`, and `dims` (name -> size) overrides any of them. Token ids are drawn below the row
    count of the table they index when a `Gather` shows it."""
    rng = np.random.default_rng(seed)
    dims = dict(dims or {})
    seq = int(dims.get("seq", seq))  # an override of seq or past_seq carries into total_seq
    table_rows = _gather_rows(model)
    feeds = []
    for i in range(n):
        p = int(dims["past_seq"]) if "past_seq" in dims else (past if past or i % 2 == 0 else 4)
        known = {**_DIM_DEFAULTS, "seq": seq, "past_seq": p, "total_seq": p + seq, **dims}
        feed: dict[str, np.ndarray] = {}
        for value in model.graph.inputs:
            shape = [d if isinstance(d, int) else dim_value(str(d), known) for d in (value.shape or [])]
            name, dtype = name_of(value), _np_dtype(value.dtype)
            if name == names.ATTENTION_MASK:
                feed[name] = np.ones(shape, dtype)
            elif name == names.POSITION_IDS:
                feed[name] = np.broadcast_to(np.arange(p, p + shape[-1]), shape).astype(dtype)
            elif name == names.INPUT_IDS or (np.issubdtype(dtype, np.integer) and table_rows.get(name)):
                vocab = embeddings.shape[0] if embeddings is not None else (table_rows.get(name) or 100)
                feed[name] = rng.integers(0, vocab, shape).astype(dtype)
            elif name == names.INPUTS_EMBEDS and embeddings is not None:
                ids = rng.integers(0, embeddings.shape[0], shape[:-1])
                feed[name] = embeddings[ids].astype(dtype)
            elif np.issubdtype(dtype, np.integer):
                feed[name] = np.zeros(shape, dtype)
            else:
                feed[name] = rng.standard_normal(shape).astype(dtype)
        feeds.append(feed)
    return feeds


def capture_values(
    model: ir.Model, value_names: Sequence[str], feeds: Sequence[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The values named `value_names` (e.g. each weight MatMul's activation input) on every feed, flattened to
    (tokens, features) and concatenated across feeds. The values are made graph outputs only for the session
    (`check.session`, which goes through files for a model too big to serialize or with external weights) and
    the model is left as it was."""
    from .check import session

    produced = {v.name: v for node in model.graph for v in node.outputs}
    produced.update({v.name: v for v in model.graph.inputs})
    existing = {o.name for o in model.graph.outputs}
    added = [produced[n] for n in dict.fromkeys(value_names) if n not in existing]
    model.graph.outputs.extend(added)
    try:
        sess = session(model, optimize=False)  # keep every named value
    finally:
        for v in added:
            model.graph.outputs.remove(v)
    wanted = {i.name for i in sess.get_inputs()}
    chunks: dict[str, list[np.ndarray]] = {n: [] for n in value_names}
    for feed in feeds:
        outs = sess.run(list(value_names), {k: v for k, v in feed.items() if k in wanted})
        for name, arr in zip(value_names, outs):
            chunks[name].append(arr.reshape(-1, arr.shape[-1]).astype(np.float32))
    return {n: np.concatenate(c) for n, c in chunks.items()}


def record_decoder_feeds(
    model_dir: str | Path,
    n: int = 8,
    *,
    split: str = "train",
    start: int = 0,
    prompt: str = "",
    family: str = DEFAULT_MODEL,
) -> list[dict[str, np.ndarray]]:
    """Real prefill feeds for the decoder: the model family's calibration studies of `split` through the graphs'
    vision encoder and embeddings (ONNX Runtime), arranged as the reporter does: the prompt of
    `generation_config.json` (`edgekit.prompt.prompt_layout`) with the image span at its slot
    (`edgekit.generate.place_image`), the pixels preprocessed by the `preprocessor_config.json` beside the graphs
    (an imported VLM's own size and frame count), else the family's."""
    from edgekit.generate import place_image
    from edgekit.ort import CpuBackend
    from edgekit.positions import PositionScheme
    from edgekit.preprocess import PreprocessConfig, preprocess_frames
    from edgekit.prompt import prompt_layout

    model_dir = Path(model_dir)
    fam = get_model_family(family)
    backend = CpuBackend.from_dir(model_dir, intra_op_threads=1)
    tokenizer = _tokenizer(_beside_or_family(model_dir, names.WEIGHT_FILES["tokenizer"], fam))
    generation = _json(_beside_or_family(model_dir, names.WEIGHT_FILES["generation_config"], fam))
    cfg = PreprocessConfig.load(_beside_or_family(model_dir, names.WEIGHT_FILES["preprocessor_config"], fam))
    scheme = PositionScheme.beside(model_dir)  # the decoder's kind of position_ids (M-RoPE: Qwen2-VL)
    feeds = []
    for study in fam.calibration_studies(n, split=split, start=start):
        image = backend.encode_images(preprocess_frames(study.frames, cfg)[None])
        layout = prompt_layout(tokenizer, generation, study.modality, prompt)
        embeds = backend.embed(np.asarray([layout.ids], np.int64))
        x, _mask = place_image(embeds, np.ones(embeds.shape[:2], np.int64), image, layout.image_slot)
        x = x.astype(np.float32)
        seq = x.shape[1]
        feed = {
            names.INPUTS_EMBEDS: x,
            names.ATTENTION_MASK: np.ones((1, seq), np.int64),
            names.POSITION_IDS: scheme.prefill(np.ones((1, seq), np.int64), layout.image_slot, image.shape[1])[0],
        }
        for layer, (k, v) in enumerate(backend.empty_past(1)):
            feed[names.past_key(layer)] = k
            feed[names.past_value(layer)] = v
        feeds.append(feed)
    return feeds


def vision_feeds(
    model: ir.Model, n: int, *, seed: int = 0, family: str = DEFAULT_MODEL
) -> list[dict[str, np.ndarray]] | None:
    """`n` `pixel_values` feeds from the model family's calibration studies (train split, from study `seed`),
    preprocessed as the reporter does; None when the graph's input does not have that shape (e.g. an imported
    Hugging Face encoder). Why not noise: Gaussian pixels calibrate the patch statistics of noise."""
    from edgekit.preprocess import PreprocessConfig, preprocess_frames

    value = {v.name: v for v in model.graph.inputs}.get(names.PIXEL_VALUES)
    if value is None or value.shape is None:
        return None
    cfg = PreprocessConfig()
    feeds = []
    for study in get_model_family(family).calibration_studies(n, split="train", start=seed):
        pixels = preprocess_frames(study.frames, cfg)[None].astype(np.float32)
        dims = list(value.shape)
        if len(dims) != pixels.ndim or any(isinstance(d, int) and d != p for d, p in zip(dims, pixels.shape)):
            return None
        feeds.append({names.PIXEL_VALUES: pixels})
    return feeds


def _beside_or_family(model_dir: Path, file_name: str, fam) -> Path:
    """`file_name` beside the graphs, else the model family's own (the weights the graphs were exported from)."""
    here = model_dir / file_name
    return here if here.is_file() else fam.weights_dir() / file_name


def _tokenizer(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        raise ConfigError("tokenizer not found", path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # a corrupt tokenizer is a user file problem
        raise ConfigError(f"cannot read tokenizer ({type(exc).__name__})", path) from exc


def _json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError("generation config not found", path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"not valid JSON ({exc})", path) from exc
