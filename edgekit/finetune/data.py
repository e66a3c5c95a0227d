"""Fine-tuning data: JSON Lines in the two layouts Hugging Face's trainers (TRL) read, tokenized once.

    {"text": "FINDINGS: ..."}                                   language modelling: every token is learned
    {"prompt": "Cough.", "completion": "FINDINGS: ..."}          only the completion is learned
    {"image": "cr_0001.png", "prompt": "...", "completion": "..."}   a VLM: the prompt as edgekit serves it

`image` is a path relative to the JSONL file: a DICOM file, series folder or zip (read by edgekit's ingest), or
anything Pillow reads; made grey and resized to the vision tower's size, as edgekit serves images. Its prompt
goes through the bundle's template with the image span at the template's slot (`edgekit.prompt.prompt_layout`):
the model learns on the layout it will be served with.
Every bad line is reported with its line number before any training starts; examples longer than `max_length`
are cut at the end, and counted so the result says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgekit.errors import ConfigError
from edgekit.preprocess import PreprocessConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer

IGNORE = -100  # label of a token that is not learned (transformers' convention)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]
    image: Path | None = None


@dataclass
class Dataset:
    path: Path
    examples: list[Example]
    truncated: int = 0  # examples cut to max_length
    layout: str = ""
    problems: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)


@dataclass(frozen=True)
class Tokenization:
    """How text becomes ids for one model: its tokenizer, end token, and (VLMs) the image span's ids and the
    generation config a bundle of it serves with (its prompt template and image slot)."""

    tokenizer: Tokenizer
    eos_id: int | None
    image_span: tuple[int, ...] = ()
    generation_config: Mapping | None = None

    def image_prompt(self, modality: str, prompt: str) -> list[int]:
        """The served prefill's ids: the template's text with the image span at its slot."""
        from edgekit.prompt import prompt_layout

        layout = prompt_layout(self.tokenizer, self.generation_config or {}, modality, prompt)
        s = layout.image_slot
        return [*layout.ids[:s], *self.image_span, *layout.ids[s:]]

    def encode(self, text: str, *, first: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=first).ids)


def _record(line: str, where: str, vlm: bool) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected an object, got {type(rec).__name__}")
    has_text, has_pair = "text" in rec, "prompt" in rec or "completion" in rec
    if has_text == has_pair:
        raise ValueError(f"{where}: needs either 'text' or 'prompt' + 'completion'")
    for key in ("text",) if has_text else ("prompt", "completion"):
        if not isinstance(rec.get(key), str) or (key != "prompt" and not rec[key].strip()):
            raise ValueError(f"{where}: '{key}' must be a non-empty string")
    if "image" in rec:
        if not vlm:
            raise ValueError(f"{where}: 'image' given, but the model has no vision tower")
        if not isinstance(rec["image"], str) or has_text:
            raise ValueError(f"{where}: 'image' must be a path string, with 'prompt' + 'completion'")
    return rec


def read_dataset(path: str | Path, tok: Tokenization, max_length: int, *, vlm: bool = False) -> Dataset:
    """Read and tokenize a JSONL file; raises one `ConfigError` listing every bad line (up to 10)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read fine-tuning data ({type(exc).__name__})", path) from None
    examples, problems, truncated, kinds = [], [], 0, set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = _record(line, f"line {n}", vlm)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        image = None
        if "image" in rec:
            image = (path.parent / rec["image"]).resolve()
            if not image.exists():
                problems.append(f"line {n}: image {rec['image']!r} not found")
                continue
        if "text" in rec:
            ids = tok.encode(rec["text"], first=True) + ([tok.eos_id] if tok.eos_id is not None else [])
            labels = list(ids)
        else:
            if image:
                head = tok.image_prompt(str(rec.get("modality", "")), rec["prompt"])
            else:
                head = tok.encode(rec["prompt"], first=True)
            tail = tok.encode(rec["completion"], first=False) + ([tok.eos_id] if tok.eos_id is not None else [])
            ids, labels = head + tail, [IGNORE] * len(head) + tail
        if len(ids) > max_length:
            truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        if all(label == IGNORE for label in labels[1:]):
            problems.append(f"line {n}: nothing left to learn within max_length {max_length}")
            continue
        examples.append(Example(ids, labels, image))
        kinds.add("text" if "text" in rec else "image+prompt+completion" if image else "prompt+completion")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ConfigError(f"{len(problems)} bad line(s) in fine-tuning data: {shown}", path)
    if not examples:
        raise ConfigError("no examples in fine-tuning data", path)
    return Dataset(path, examples, truncated, ", ".join(sorted(kinds)))


def load_grey(path: Path, size: int) -> np.ndarray:
    """An image as (size, size) grey in [0, 1], as edgekit serves it to an imported VLM: a DICOM file, series
    folder or zip through edgekit's ingest (display values, the middle frame), anything else through Pillow;
    resized with the BOX filter."""
    from edgekit.preprocess import preprocess_frames

    frames = _pixels(path)
    cfg = PreprocessConfig(image_size=size, num_frames=1, mean=0.0, std=1.0)
    return preprocess_frames(frames, cfg)[0, 0]


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if path.is_file() and path.suffix.lower() not in (".dcm", ".zip", ""):
        try:
            with Image.open(path) as im:
                return np.asarray(im.convert("L"), np.float32) / 255.0
        except (OSError, UnidentifiedImageError) as exc:
            raise ConfigError(f"cannot read image ({type(exc).__name__})", path) from None
    from edgekit.ingest import load_study

    return load_study(path).frames  # DICOM: its own errors name the file and the reason
