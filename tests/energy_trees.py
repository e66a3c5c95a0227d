"""The sysfs fixture trees (tests/fixtures/sysfs, real layouts) and a writable copy of one, for tests that change
a reading or take a file away mid-run."""

import shutil
from pathlib import Path

TREES = Path(__file__).parent / "fixtures" / "sysfs"


def tree(name: str) -> Path:
    return TREES / name


def copy_tree(name: str, dest: Path) -> Path:
    out = dest / name
    shutil.copytree(TREES / name, out)
    return out


def write(root: Path, path: str, value) -> None:
    """Set one attribute, as the kernel would show it (`path` as on the device)."""
    f = root / path.lstrip("/")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(f"{value}\n")
