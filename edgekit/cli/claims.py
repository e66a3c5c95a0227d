"""An output is claimed before the work starts: a command never ends a long run on a file it may not write.

`claim_out(path, force)` refuses an output that already exists (a file, or a folder with something in it), naming
it, unless `--force` is given; `writable_out(path)` refuses one that cannot be created (under a file, in a folder
not writable). `options.out_option` runs the claim as `--out`'s callback, before the command body; a command whose
outputs are not one `--out` (`bundle unpack`, `pareto`'s profile) calls them itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from edgekit.errors import ConfigError


def output_exists(path: Path) -> bool:
    """A file, or a folder with something in it: what `--out` refuses to replace without `--force`."""
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


def writable_out(path: Path) -> None:
    """Refuse an output that cannot be created: the nearest existing folder above it is a file, or not writable.

    Checked before any work, so a long build never ends on a traceback from `mkdir`."""
    above = path.parent
    while not (above.exists() or above.is_symlink()) and above.parent != above:
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"cannot be written: {above} is a file, not a folder", path)
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot be written: no permission to write in {above}", path)


def claim_out(path: Path | None, force: bool) -> None:
    """Refuse to write over an existing output unless `--force` was given, and an output that cannot be written."""
    if path is None:
        return
    if not force and output_exists(path):
        raise ConfigError("already exists; pass --force to replace it", path)
    writable_out(path)
