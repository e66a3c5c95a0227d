"""Convert between the two bundle forms: a directory and a single `.ekb` file (stored zip).

Both directions verify first, so a corrupt bundle is never packed or unpacked into something that looks good.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from edgekit.bundle.io import ARCHIVE_SUFFIX, load_bundle, replace_dir, zip_dir
from edgekit.errors import BundleError


def pack_bundle(src: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Verify the bundle directory `src` and write it as one `.ekb` file (default: `<src>.ekb`)."""
    src = Path(src)
    if not src.is_dir():
        raise BundleError("pack takes a bundle directory", src)
    bundle = load_bundle(src, required_roles=())
    out = Path(out) if out is not None else src.with_name(src.name + ARCHIVE_SUFFIX)
    if out.suffix != ARCHIVE_SUFFIX:
        out = out.with_name(out.name + ARCHIVE_SUFFIX)
    out.parent.mkdir(parents=True, exist_ok=True)
    zip_dir(bundle.root, out)
    return out


def unpack_bundle(src: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Verify the archive `src` and copy its contents to the directory `out` (default: `src` minus `.ekb`)."""
    src = Path(src)
    if src.is_dir():
        raise BundleError("unpack takes an .ekb file, not a directory", src)
    bundle = load_bundle(src, required_roles=())
    out = Path(out) if out is not None else src.with_suffix("")
    if out.exists() and not out.is_dir():
        raise BundleError("exists and is not a directory", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shutil.copytree(bundle.root, tmp, dirs_exist_ok=True)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
