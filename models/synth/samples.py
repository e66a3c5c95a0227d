"""The committed sample studies under `models/samples/`: small, real files for docs, demos and smoke tests.

They come from the "sample" split, so regenerating them (`python -m edgekit.models.synth.samples` in a checkout)
rewrites the same bytes. Each folder `<kind>/` holds only the study's files, so loading the folder warns about
nothing; its ground truth is `<kind>.json` beside it (a study record as in `studies.jsonl`, paths relative to that
file). An installed package's samples are never rewritten in place: there the command needs `--out DIR`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from pydicom.uid import JPEG2000Lossless, JPEGBaseline8Bit, RLELossless

from .dicom_writer import write_dicom
from .generator import SynthStudy, generate_study
from .splits import study_record
from .video_writer import write_mp4

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
SAMPLE_SPLIT = "sample"


def _wanted(kind: str, study: SynthStudy) -> bool:
    """A sample should show something: findings, and a compressed transfer syntax to exercise the decoders."""
    if kind == "ct_chest":
        return len(study.findings) >= 2 and study.transfer_syntax in (str(RLELossless), str(JPEG2000Lossless))
    if kind == "cr_chest":
        return len(study.findings) >= 2 and study.transfer_syntax == str(JPEG2000Lossless)
    return len(study.findings) >= 1 and study.transfer_syntax == str(JPEGBaseline8Bit)


def pick_samples(kinds=("ct_chest", "cr_chest", "us_cardiac"), limit: int = 400) -> dict[str, SynthStudy]:
    picked: dict[str, SynthStudy] = {}
    for i in range(limit):
        study = generate_study(i, SAMPLE_SPLIT)
        if study.kind in kinds and study.kind not in picked and _wanted(study.kind, study):
            picked[study.kind] = study
        if len(picked) == len(kinds):
            break
    return picked


def ground_truth_path(kind: str, samples_dir: str | Path = SAMPLES_DIR) -> Path:
    """Where the ground truth of sample `kind` lives: `<kind>.json` beside the study folder, not inside it."""
    return Path(samples_dir) / f"{kind}.json"


def regenerate_samples(dest: str | Path = SAMPLES_DIR) -> list[Path]:
    """(Re)write the sample studies into `dest/<kind>/` and their ground truth into `dest/<kind>.json`; returns
    every file written."""
    dest = Path(dest)
    written: list[Path] = []
    for kind, study in pick_samples().items():
        folder = dest / kind
        if folder.exists():
            shutil.rmtree(folder)
        files = write_dicom(study, folder)
        video = write_mp4(study.stored, folder / "cine.mp4", study.frame_rate) if study.is_cine else None
        path = folder if study.modality in ("CT", "MR") else files[0]
        rel = lambda p: p.relative_to(dest).as_posix()  # noqa: E731
        rec = study_record(study, rel(path), rel(video) if video else None, len(files) + (1 if video else 0))
        truth = ground_truth_path(kind, dest)
        truth.write_text(json.dumps(rec, indent=2) + "\n")
        written += files + ([video] if video else []) + [truth]
    return written


def _in_checkout(folder: Path) -> bool:
    """True for the source tree's models/samples (the repository root holds pyproject.toml), not an installed copy."""
    return (folder.parent.parent / "pyproject.toml").is_file() and "site-packages" not in folder.parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edgekit.models.synth.samples",
        description="Regenerate the committed sample studies (ct_chest, cr_chest, us_cardiac) from the sample split.",
        epilog=f"Without --out: {SAMPLES_DIR}, and only in a source checkout; an installed package is never rewritten.",
    )
    parser.add_argument("--out", type=Path, help="Folder to write <kind>/ into (default: the checkout's samples).")
    args = parser.parse_args(argv)
    if args.out is None and not _in_checkout(SAMPLES_DIR):
        parser.exit(2, f"error: {SAMPLES_DIR}: an installed package, not a checkout; pass --out DIR\n")
    for p in regenerate_samples(args.out if args.out is not None else SAMPLES_DIR):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
