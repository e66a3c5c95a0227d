"""Reading sysfs-style files below a root directory.

Every reader in `edgekit.energy` takes a root ("/" on a device, a fixture tree in tests, as jtop's `JTOP_TESTING`
does), so the same code reads a board and a copy of its layout. Paths are joined here and nowhere else.
"""

from __future__ import annotations

import glob
from pathlib import Path


def under(root: str | Path, path: str) -> Path:
    """`path` (absolute, as on the device) below `root`."""
    return Path(root) / path.lstrip("/")


def matching(root: str | Path, pattern: str) -> list[Path]:
    """Sorted paths below `root` matching a glob written as on the device (`/sys/class/thermal/thermal_zone*`)."""
    base = str(Path(root))
    return sorted(Path(p) for p in glob.glob(str(under(root, pattern))) if p.startswith(base))


def read_text(path: Path) -> str:
    """A sysfs attribute without its trailing newline (and device-tree strings without their NUL)."""
    return path.read_text(errors="replace").strip().rstrip("\x00").strip()


def read_int(path: Path) -> int:
    """An integer attribute; raises ValueError naming the file for anything else (a driver printing garbage)."""
    text = read_text(path)
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        raise ValueError(f"{path}: expected an integer, read {text[:40]!r}") from None


def optional_text(path: Path) -> str | None:
    try:
        return read_text(path)
    except OSError:
        return None


def optional_int(path: Path) -> int | None:
    try:
        return read_int(path)
    except (OSError, ValueError):
        return None
