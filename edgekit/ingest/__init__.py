"""Study ingest: DICOM files, series folders, zips of a series and videos -> `Study` display frames.

Names are resolved lazily so that `edgekit.ingest.pixels` (used by training and synthetic data) does not pull in
pydicom and its decoders.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_study": "edgekit.ingest.load",
    "Study": "edgekit.ingest.study",
    "IngestLimits": "edgekit.ingest.study",
    "hash_uid": "edgekit.ingest.phi",
    "phi_guard": "edgekit.ingest.phi",
    "to_display": "edgekit.ingest.pixels",
    "display_entropy_bits": "edgekit.ingest.entropy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'edgekit.ingest' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
