"""The `Study` every reader returns and the `IngestLimits` every reader obeys."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgekit.errors import ConfigError


@dataclass
class Study:
    """Display frames of one series plus non-identifying facts about it.

    `frames` is float32 (n, H, W) in [0, 1]; `meta` never holds names, IDs or dates; `warnings` are scrubbed.
    """

    frames: np.ndarray
    modality: str
    uid_hash: str
    source: str  # "dicom" | "video"
    meta: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    ingest_ms: float = 0.0  # wall time `load_study` took, so a report on a loaded study still says it
    ingest_wait_ms: float | None = None  # time it waited to be decoded: a busy ingest process; edgekitd adds the
    # wait for an ingest thread (None: decoded by its caller, outside edgekitd)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


Allocator = Callable[[tuple[int, ...]], np.ndarray]  # a float32 C-ordered array of that shape
_ALLOCATOR: ContextVar[Allocator | None] = ContextVar("edgekit_frames_allocator", default=None)


def allocate_frames(shape: tuple[int, ...]) -> np.ndarray:
    """The one array a reader decodes a study's display frames into (float32, uninitialised): plain memory, or
    what `frames_allocated_by` says (an ingest worker's memfd, so the frames reach the daemon without a copy)."""
    allocator = _ALLOCATOR.get()
    return np.empty(shape, dtype=np.float32) if allocator is None else allocator(shape)


@contextmanager
def frames_allocated_by(allocator: Allocator) -> Iterator[None]:
    token = _ALLOCATOR.set(allocator)
    try:
        yield
    finally:
        _ALLOCATOR.reset(token)


@dataclass(frozen=True)
class IngestLimits:
    """Upper bounds that stop a hostile or mistaken input from exhausting memory; exceeding one is a StudyError.

    `video_max_frames` is not a limit but a sampling target: longer videos keep that many evenly spaced frames.
    """

    max_files: int = 4000
    max_frames: int = 4000
    max_pixels: int = 4096 * 4096  # per frame (rows x columns)
    max_total_pixels: int = 256 * 1024 * 1024  # all frames together (1 GiB as float32)
    max_bytes: int = 4 * 1024**3  # uncompressed bytes read from a zip or folder
    video_max_frames: int = 64
    # What decoding one study may cost (edgekit.ingest.budget): its display frames, one frame's working set and
    # the encoded object being decoded. Well under edgekitd's MemoryMax=4G.
    memory_bytes: int = 1024**3
    video_max_source_frames: int = 200_000  # frames a video may hold: 1 h 50 min at 30 fps (a new refusal)
    video_decode_s: float = 120.0  # wall time one video's decode may take

    def __post_init__(self) -> None:
        names = ("max_files", "max_frames", "max_pixels", "max_total_pixels", "max_bytes", "video_max_frames")
        for name in (*names, "memory_bytes", "video_max_source_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"IngestLimits.{name} must be a positive integer, got {value!r}")
        if isinstance(self.video_decode_s, bool) or not (
            isinstance(self.video_decode_s, (int, float)) and self.video_decode_s > 0
        ):
            raise ConfigError(f"IngestLimits.video_decode_s must be > 0 seconds, got {self.video_decode_s!r}")
