"""Training data for radreport-tiny: synthetic studies -> cached pixel tensors + tokenised prompts and reports.

Pixels go through `to_display` and `preprocess_frames`, the functions inference uses, so the model trains on
exactly what it will see. Everything is a pure function of (split, index, seed, epoch): two runs build
bit-identical batches. Preprocessed pixels are rounded to float16 whether or not they come from the on-disk
cache, so a warm cache never changes a run's result. No torch here: batches are numpy arrays.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import pickle
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.preprocess import PreprocessConfig, preprocess_frames

from .tokenizer import EOS_ID, PAD_ID, encode_prompt, encode_text

IGNORE = -100  # label of positions that carry no loss (prompt, padding)


def _finding_labels() -> tuple[tuple[str, str | None, str | None], ...]:
    """(type, location, None) presence labels first, then (type, location, "n=C") count and (type, location,
    "S mm") size labels of the counted and sized types: what a report states about each finding."""
    from edgekit.findings import KINDS

    specs = {(f.type, loc): f for k in KINDS for f in k.findings for loc in (f.locations or (None,))}
    order = sorted(specs, key=lambda p: (p[0], p[1] or ""))
    presence: list[tuple[str, str | None, str | None]] = [(t, loc, None) for t, loc in order]
    attributes: list[tuple[str, str | None, str | None]] = [
        (t, loc, f"n={c}")
        for t, loc in order
        for c in range(1, specs[t, loc].max_count + 1)
        if specs[t, loc].max_count > 1
    ]
    attributes += [(t, loc, f"{s} mm") for t, loc in order for s in specs[t, loc].sizes_mm]
    return tuple(presence + attributes)


def _count_channels() -> tuple[tuple[str, str | None], ...]:
    """(type, location) of every counted finding: one channel per side, so a token that counts a nodule also has
    to say which lung it is in (a channel shared by both sides let the decoder lose the side)."""
    from edgekit.findings import KINDS

    return tuple(
        sorted(
            {(f.type, loc) for k in KINDS for f in k.findings if f.max_count > 1 for loc in (f.locations or (None,))},
            key=lambda p: (p[0], p[1] or ""),
        )
    )


FINDING_LABELS = _finding_labels()  # the targets of the training-only finding probe
COUNT_CHANNELS = _count_channels()  # the channels of the count maps, targets of the training-only count-map probe
PRESENCE_LABELS = sum(1 for label in FINDING_LABELS if label[2] is None)  # the first columns: presence only
_LABEL_INDEX = {p: i for i, p in enumerate(FINDING_LABELS)}


def finding_label_vector(findings) -> np.ndarray:
    """Multi-hot labels of one study's findings: presence of each (type, location), then its count and size."""
    v = np.zeros(len(FINDING_LABELS), np.float32)
    for f in findings:
        v[_LABEL_INDEX[(f.type, f.location, None)]] = 1.0
        for attribute in (f"n={f.count}", f"{f.size_mm} mm" if f.size_mm else None):
            index = _LABEL_INDEX.get((f.type, f.location, attribute))
            if index is not None:
                v[index] = 1.0
    return v


def count_map(centres, cells: int) -> np.ndarray:
    """(len(COUNT_CHANNELS), cells * cells): how many findings of each counted (type, location) are centred in
    each cell of a cells x cells grid over the image, row-major like the image tokens. `centres` are (type,
    location, row, col) with row and col as fractions of the image height and width."""
    m = np.zeros((len(COUNT_CHANNELS), cells * cells), np.float32)
    for type_, location, row, col in centres:
        r, c = (min(cells - 1, max(0, int(v * cells))) for v in (row, col))
        m[COUNT_CHANNELS.index((type_, location)), r * cells + c] += 1.0
    return m


VIDEO_MODALITY = "XC"  # what a cine loop served as MP4 is called at inference
CACHE_VERSION = 2


@dataclass(frozen=True)
class StudyText:
    """The text side of one study: what the prompt says and every accepted phrasing of its report."""

    index: int
    modality: str
    indication: str
    references: tuple[str, ...]
    is_cine: bool
    findings: tuple  # synth.Finding, for evaluation
    negatives: tuple[str, ...]
    centres: tuple = ()  # (type, location, row, col) of each counted finding drawn; row, col: fractions of the size


@dataclass
class SplitData:
    split: str
    pixels: np.ndarray  # float16 (n, frames, 1, S, S)
    texts: list[StudyText]

    def __len__(self) -> int:
        return len(self.texts)

    def digest(self) -> str:
        """sha256 over pixels and text: names the exact data a model was trained on."""
        h = hashlib.sha256(self.pixels.tobytes())
        for t in self.texts:
            h.update(json.dumps([t.modality, t.indication, list(t.references)]).encode())
        return h.hexdigest()


def _default_generate(index: int, split: str):
    from edgekit.models.synth import generate_study

    return generate_study(index, split)


def is_cine(study) -> bool:
    """Ultrasound loops (more than one frame) are the studies also served as MP4 video."""
    return study.modality == "US" and np.asarray(study.stored).shape[0] > 1


def study_pixels(study, cfg: PreprocessConfig) -> np.ndarray:
    """Model input of one synthetic study, through the same two functions inference uses."""
    display = study.display()
    return preprocess_frames(display, cfg)


def _make_one(args) -> tuple[np.ndarray, StudyText]:
    index, split, cfg, generate = args
    study = (generate or _default_generate)(index, split)
    height, width = np.asarray(study.stored).shape[-2:]
    text = StudyText(
        index=index,
        modality=study.modality,
        indication=study.indication,
        references=tuple(study.references),
        is_cine=is_cine(study),
        findings=tuple(study.findings),
        negatives=tuple(study.negatives),
        centres=tuple(
            (f.type, f.location, y / height, x / width)
            for f in study.findings
            for y, x in study.centres.get(f.type, ())
        ),
    )
    return study_pixels(study, cfg).astype(np.float16), text


def build_split(
    split: str,
    n: int,
    cfg: PreprocessConfig,
    *,
    cache_dir: str | Path | None = None,
    workers: int = 1,
    generate: Callable | None = None,
) -> SplitData:
    """Generate and preprocess studies 0..n-1 of `split` (or read them from `cache_dir` when built before)."""
    cache = None
    if cache_dir is not None and generate is None:
        key = hashlib.sha256(json.dumps([CACHE_VERSION, split, n, cfg.to_dict(), source_digest()]).encode())
        cache = Path(cache_dir) / f"{split}-{n}-{key.hexdigest()[:16]}"
        if (cache / "pixels.npy").exists() and (cache / "texts.pkl").exists():
            pixels = np.load(cache / "pixels.npy")
            texts = pickle.loads((cache / "texts.pkl").read_bytes())
            return SplitData(split, pixels, texts)
    jobs = [(i, split, cfg, generate) for i in range(n)]
    if workers > 1 and n > 1:
        # spawn, not fork: the parent may already run torch's OpenMP pool, which does not survive a fork
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            made = list(pool.map(_make_one, jobs, chunksize=max(1, n // (8 * workers))))
    else:
        made = [_make_one(j) for j in jobs]
    pixels = (
        np.stack([m[0] for m in made])
        if made
        else np.zeros((0, cfg.num_frames, 1, cfg.image_size, cfg.image_size), np.float16)
    )
    data = SplitData(split, pixels, [m[1] for m in made])
    if cache is not None:
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "pixels.npy", pixels)
        (tmp / "texts.pkl").write_bytes(pickle.dumps(data.texts))
        shutil.rmtree(cache, ignore_errors=True)
        tmp.rename(cache)  # a run killed mid-write leaves only the .tmp folder, never a half cache
    return data


def source_digest() -> str:
    """sha256 of the code that makes the data (generator, display and preprocessing): a cache key part, so a
    changed generator never serves stale pixels."""
    import edgekit.ingest.pixels
    import edgekit.models.synth
    import edgekit.preprocess

    files = sorted(Path(edgekit.models.synth.__file__).parent.glob("*.py"))
    files += [Path(edgekit.ingest.pixels.__file__), Path(edgekit.preprocess.__file__)]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def tokenizer_corpus(data: SplitData) -> list[str]:
    """Every reference phrasing, indication and modality name of a split: what the tokenizer is trained on."""
    out = {VIDEO_MODALITY}
    for t in data.texts:
        out.add(t.modality)
        out.add(t.indication)
        out.update(t.references)
    return sorted(out)


@dataclass
class EncodedSplit:
    """Token ids, computed once: prompts per modality name the study may be shown with, and every reference."""

    data: SplitData
    prompts: list[dict[str, list[int]]]
    references: list[list[list[int]]]


def encode_split(tok, data: SplitData) -> EncodedSplit:
    prompts, refs = [], []
    for t in data.texts:
        names = [t.modality] + ([VIDEO_MODALITY] if t.is_cine else [])
        prompts.append({m: encode_prompt(tok, m, t.indication) for m in names})
        refs.append([encode_text(tok, r) + [EOS_ID] for r in t.references])
    return EncodedSplit(data, prompts, refs)


def make_batch(
    enc: EncodedSplit, items: Sequence[tuple[int, str, int]], count_cells: int | None = None
) -> dict[str, np.ndarray]:
    """Items are (study, modality name, reference). Right-padded; labels are IGNORE except on report and <eos>.

    `labels[b, t]` is the target of text position t itself (not shifted); the loss compares logits at t - 1.
    With `count_cells`, also each study's `count_map` on that grid (the image tokens' grid).
    """
    seqs, starts = [], []
    for i, modality, r in items:
        prompt = enc.prompts[i][modality]
        seqs.append(prompt + enc.references[i][r])
        starts.append(len(prompt))
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), PAD_ID, np.int64)
    mask = np.zeros((len(seqs), width), np.int64)
    labels = np.full((len(seqs), width), IGNORE, np.int64)
    for b, (s, start) in enumerate(zip(seqs, starts)):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
        labels[b, start : len(s)] = s[start:]
    pixels = enc.data.pixels[[i for i, _, _ in items]].astype(np.float32)
    findings = np.stack([finding_label_vector(enc.data.texts[i].findings) for i, _, _ in items])
    batch: dict[str, np.ndarray] = {
        "pixel_values": pixels,
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "finding_labels": findings,
    }
    if count_cells is not None:
        batch["count_maps"] = np.stack([count_map(enc.data.texts[i].centres, count_cells) for i, _, _ in items])
    return batch


def epoch_items(
    enc: EncodedSplit, seed: int, epoch: int, xc_share: float, phrasings: int | None = None
) -> list[tuple[int, str, int]]:
    """A shuffled pass over the split: a random one of the first `phrasings` references per study (None: of all),
    and "XC" for `xc_share` of cine studies. The draws do not depend on `phrasings`."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(enc.data))
    pick_ref = rng.random(len(order))
    pick_xc = rng.random(len(order))
    items = []
    for k, i in enumerate(order.tolist()):
        t = enc.data.texts[i]
        modality = VIDEO_MODALITY if t.is_cine and pick_xc[k] < xc_share else t.modality
        choices = len(enc.references[i]) if phrasings is None else min(phrasings, len(enc.references[i]))
        items.append((i, modality, int(pick_ref[k] * choices)))
    return items


def iterate_batches(
    enc: EncodedSplit,
    *,
    batch_size: int,
    epochs: int,
    seed: int,
    xc_share: float = 0.3,
    phrasings: int | None = None,
    count_cells: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """All training batches in order; the last short batch of an epoch is dropped so every step has equal weight."""
    for epoch in range(epochs):
        items = epoch_items(enc, seed, epoch, xc_share, phrasings)
        for start in range(0, len(items) - batch_size + 1, batch_size):
            yield make_batch(enc, items[start : start + batch_size], count_cells)


def eval_items(enc: EncodedSplit) -> list[tuple[int, str, int]]:
    """Every val study with its own modality name and first reference, plus the cine studies once more as XC."""
    items = [(i, t.modality, 0) for i, t in enumerate(enc.data.texts)]
    items += [(i, VIDEO_MODALITY, 0) for i, t in enumerate(enc.data.texts) if t.is_cine]
    return items
