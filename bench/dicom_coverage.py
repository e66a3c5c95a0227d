"""How much real-world DICOM `load_study` accepts: every file pydicom ships in its wheel, accepted or refused.

pydicom's own test files are the widest set of real encodings at hand (vendors, transfer syntaxes, photometric
interpretations, deliberately malformed objects) and come with the installed package, so nothing is downloaded.
Each file is loaded on its own; a refusal prints the reason `load_study` gave, so a reader can judge whether the
refusal is right (not an image, deliberately broken, or a codec we will not ship) or a gap in ingest.

Files that are not DICOM at all (pydicom's JSON, text dumps, ICC profiles, gzip) are listed apart and not counted.

    python bench/dicom_coverage.py [--out bench/dicom_coverage.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import warnings
from pathlib import Path

import pydicom
from pydicom.data import get_testdata_files

from edgekit.errors import EdgekitError
from edgekit.ingest import load_study


def _is_dicom(path: Path) -> bool:
    """A DICM preamble, or a bare dataset pydicom itself reads without being forced."""
    with path.open("rb") as fh:
        head = fh.read(132)
    if head[128:132] == b"DICM":
        return True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pydicom.dcmread(path, stop_before_pixels=True)
    except Exception:
        return False
    return True


def _transfer_syntax(path: Path) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = pydicom.dcmread(path, stop_before_pixels=True, force=True)
        ts = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    except Exception:
        return "(unreadable)"
    if ts is None:
        return "(no file meta)"
    name = pydicom.uid.UID(str(ts)).name
    return f"{name} ({ts})" if name != str(ts) else str(ts)


def survey() -> dict:
    files = sorted(p for p in map(Path, get_testdata_files()) if p.is_file())
    root = Path(pydicom.data.__file__).parent / "test_files"
    rows, not_dicom = [], []
    for path in files:
        rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        if not _is_dicom(path):
            not_dicom.append(rel)
            continue
        row = {"file": rel, "transfer_syntax": _transfer_syntax(path)}
        try:
            study = load_study(path)
        except EdgekitError as err:
            row.update(accepted=False, code=err.code, reason=err.reason)
        except Exception as err:  # a stray exception is a bug in ingest: count it, say so
            row.update(accepted=False, code="BUG", reason=f"{type(err).__name__}: {err}")
        else:
            row.update(accepted=True, frames=study.num_frames, modality=study.modality, warnings=study.warnings)
        rows.append(row)
    return {
        "pydicom": pydicom.__version__,
        "dicom_files": len(rows),
        "accepted": sum(r["accepted"] for r in rows),
        "refused": sum(not r["accepted"] for r in rows),
        "files": rows,
        "not_dicom": not_dicom,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/dicom_coverage.json"))
    ap.add_argument("--all", action="store_true", help="list accepted files too, not only refusals")
    a = ap.parse_args()
    result = survey()
    by_ts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for r in result["files"]:
        by_ts[r["transfer_syntax"]][0 if r["accepted"] else 1] += 1
    width = max(len(ts) for ts in by_ts)
    print(f"{'transfer syntax':<{width}}  accepted  refused")
    for ts, (ok, bad) in sorted(by_ts.items()):
        print(f"{ts:<{width}}  {ok:>8}  {bad:>7}")
    print(
        f"{'total':<{width}}  {result['accepted']:>8}  {result['refused']:>7}   "
        f"({result['dicom_files']} DICOM files shipped with pydicom {result['pydicom']}; "
        f"{len(result['not_dicom'])} non-DICOM files not counted)"
    )
    print("\nrefused:")
    for r in result["files"]:
        if not r["accepted"]:
            print(f"  {r['file']}  [{r['transfer_syntax']}]  {r['code']}: {r['reason']}")
    if a.all:
        print("\naccepted:")
        for r in result["files"]:
            if r["accepted"]:
                print(f"  {r['file']}  [{r['transfer_syntax']}]  {r['frames']} frame(s) {r['modality']}")
                for w in r["warnings"]:
                    print(f"      warning: {w}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
