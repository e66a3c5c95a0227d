"""`write_split`: a folder of synthetic studies on disk plus `studies.jsonl`, the ground truth evaluation reads.

Layout (one split per folder; paths in the index are relative to it):

    out_dir/studies.jsonl
    out_dir/test-00000/IM0001.dcm ...      CT / MR series, one file per slice
    out_dir/test-00002/image.dcm           CR / DX
    out_dir/test-00003/cine.dcm, cine.mp4  US multi-frame cine and the same loop as MP4
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from edgekit.errors import ConfigError

from .dicom_writer import write_dicom
from .generator import GENERATOR_VERSION, SPLITS, SynthStudy, generate_study
from .video_writer import write_mp4

INDEX_NAME = "studies.jsonl"
Progress = Callable[[int, int], None]


def study_record(study: SynthStudy, path: str, video_path: str | None, files: int) -> dict:
    rec: dict[str, object] = {
        "id": study.id,
        "split": study.split,
        "modality": study.modality,
        "path": path,
    }
    if video_path:
        rec["video_path"] = video_path
    rec.update(
        findings=[f.to_dict() for f in study.findings],
        negatives=list(study.negatives),
        indication=study.indication,
        references=list(study.references),
        kind=study.kind,
        transfer_syntax=study.transfer_syntax,
        num_frames=study.num_frames,
        files=files,
        generator_version=GENERATOR_VERSION,
    )
    return rec


def write_study(study: SynthStudy, out_dir: Path, *, verify: bool = True) -> dict:
    """Write one study under `out_dir/<id>/` and return its index record."""
    folder = out_dir / study.id
    if folder.exists():
        shutil.rmtree(folder)
    files = write_dicom(study, folder, verify=verify)
    video = None
    if study.is_cine:
        video = write_mp4(study.stored, folder / "cine.mp4", study.frame_rate)
    path = folder if study.modality in ("CT", "MR") else files[0]
    rel = lambda p: p.relative_to(out_dir).as_posix()  # noqa: E731
    return study_record(study, rel(path), rel(video) if video else None, len(files) + (1 if video else 0))


def _prepare(out_dir: Path, split: str) -> None:
    """Refuse to mix splits or to scribble over an unrelated folder; clear our own previous output."""
    index = out_dir / INDEX_NAME
    if index.is_file():
        old = [json.loads(line) for line in index.read_text().splitlines() if line.strip()]
        splits = {r.get("split") for r in old}
        if splits - {split}:
            raise ConfigError(
                f"already holds split {sorted(s for s in splits if s)}; write {split!r} into another folder", out_dir
            )
        for r in old:
            folder = out_dir / str(r.get("id", ""))
            if r.get("id") and folder.is_dir() and folder.parent == out_dir:
                shutil.rmtree(folder)
        index.unlink()
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError("folder is not empty and holds no studies.jsonl; choose an empty or new folder", out_dir)


def write_split(
    out_dir: str | Path, split: str, n: int, *, progress: Progress | None = None, verify: bool = True
) -> Path:
    """Write studies 0..n-1 of `split` into `out_dir`; returns the path of `studies.jsonl`.

    Each DICOM file is read back and checked against the generated pixels unless `verify` is False.
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"study count must be a non-negative integer, not {n!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("not a folder", out_dir)
    _prepare(out_dir, split)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        records.append(write_study(generate_study(i, split), out_dir, verify=verify))
        if progress:
            progress(i + 1, n)
    index = out_dir / INDEX_NAME
    tmp = index.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=False) + "\n" for r in records))
    tmp.replace(index)  # the index appears only once every study is on disk
    return index


def summarize(index: str | Path, seconds: float | None = None) -> dict:
    """Counts per kind and per transfer syntax of a written split (the `edgekit data synth --json` summary)."""
    index = Path(index)
    records = [json.loads(line) for line in index.read_text().splitlines() if line.strip()]
    out = {
        "out": str(index.parent),
        "index": str(index),
        "split": records[0]["split"] if records else None,
        "studies": len(records),
        "by_kind": dict(sorted(Counter(r["kind"] for r in records).items())),
        "by_modality": dict(sorted(Counter(r["modality"] for r in records).items())),
        "by_transfer_syntax": dict(sorted(Counter(r["transfer_syntax"] for r in records).items())),
        "videos": sum(1 for r in records if r.get("video_path")),
        "files": sum(int(r.get("files", 0)) for r in records) + 1,
        "normal_studies": sum(1 for r in records if not r["findings"]),
        "generator_version": GENERATOR_VERSION,
    }
    if seconds is not None:
        out["seconds"] = round(seconds, 3)
    return out
