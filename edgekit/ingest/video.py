"""Video files (cine loops exported as MP4 and the like) -> a `Study` of evenly spaced frames.

Only the frames that will be kept are converted, so a long clip costs a decode pass but not its memory. The study
records the `video_max_frames` it was sampled with: below the model's own frame count that is frame skipping, and
the reporter then feeds the vision encoder that many frames instead of repeating them (fewer frames, less work).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from edgekit.errors import StudyError
from edgekit.ingest import budget
from edgekit.ingest.budget import Admit
from edgekit.ingest.phi import hash_bytes, scrub
from edgekit.ingest.pixels import luminance, min_max_in_place
from edgekit.ingest.study import IngestLimits, Study, allocate_frames
from edgekit.preprocess import sample_indices

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _count_frames(path: Path, limits: IngestLimits, deadline: float) -> int:
    """Frames in the first video stream: the header's count if it has one, else packets demuxed (no decode),
    stopping once past the source-frame cap."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.frames and stream.frames > 0:
            return int(stream.frames)
        n = 0
        for packet in container.demux(stream):
            n += bool(packet.size)
            if n > limits.video_max_source_frames:
                break
            if n % 256 == 0:
                _check_deadline(deadline, limits, path)
        return n


def _allocate(
    frames: int, height: int, width: int, limits: IngestLimits, admit: Admit | None, path: Path
) -> np.ndarray:
    """The kept frames' display array, once the video's cost (those frames plus one decoded frame) is allowed."""
    if height * width > limits.max_pixels:
        raise StudyError(f"frame of {height}x{width} pixels exceeds the limit of {limits.max_pixels}", path)
    cost = budget.display_bytes(frames, height, width) + budget.frame_working_bytes(height, width, 3, 8)
    budget.check(cost, limits, path, "decoding this video")
    if admit is not None:
        admit(cost)
    return allocate_frames((frames, height, width))


def _check_deadline(deadline: float, limits: IngestLimits, path: Path) -> None:
    if time.monotonic() > deadline:
        raise StudyError(f"decoding the video took longer than {limits.video_decode_s:.0f} s; refused", path)


def load_video(path: Path, limits: IngestLimits, admit: Admit | None = None) -> Study:
    """Decode a video, keeping at most `limits.video_max_frames` evenly spaced frames as display values.

    Costed when its first kept frame is decoded (the kept frames plus one decoded frame), before any is kept;
    capped at `video_max_source_frames` and `video_decode_s`: decoding runs up to the last kept frame."""
    import av  # imported here: PyAV is heavy and only video ingest needs it

    deadline = time.monotonic() + limits.video_decode_s
    warnings: list[str] = []
    try:
        codec, fps = _probe(path, limits)
        n = _source_frames(path, limits, deadline)
        keep = limits.video_max_frames
        wanted = sample_indices(n, keep).tolist() if n > keep else list(range(n))
        slot = {index: k for k, index in enumerate(dict.fromkeys(wanted))}
        out, filled, decoded = _decode_kept(path, slot, limits, admit, deadline)
    except StudyError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, OSError, EOFError) as err:
        detail = getattr(err, "strerror", None) or str(err)[:200]  # FFmpeg's text without errno or path
        raise StudyError(f"undecodable video ({type(err).__name__}: {scrub(detail)})", path) from None
    if out is None or not filled:  # `out` is sized by the first kept frame: None when none decoded
        raise StudyError("undecodable video: no frame could be decoded", path)
    if len(filled) < len(slot):
        warnings.append(f"video held {decoded} decodable frames, not the {n} its header announced")
    frames = out[: len(filled)]  # slots fill in order, so the decoded ones are the first
    min_max_in_place(frames)  # as for a DICOM series without a window: one min-max over the kept frames
    return Study(
        frames=frames,
        modality="XC",
        uid_hash=hash_bytes(_sha256(path)),
        source="video",
        meta={
            "rows": int(frames.shape[1]),
            "columns": int(frames.shape[2]),
            "number_of_frames": int(frames.shape[0]),
            "source_frames": int(n),
            "video_max_frames": int(keep),
            "fps": round(fps, 3) if fps else None,
            "codec": codec,
            "transfer_syntax": None,
            "pixel_spacing": None,
        },
        warnings=warnings,
    )


def _probe(path: Path, limits: IngestLimits) -> tuple[str, float | None]:
    """The first video stream's codec and frame rate, once its header's frame size (when it states one) is
    within the limit."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise StudyError("no video stream in the file", path)
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        fps = float(stream.average_rate) if stream.average_rate else None
        width, height = stream.codec_context.width, stream.codec_context.height
    if width and height and width * height > limits.max_pixels:
        raise StudyError(f"frame of {height}x{width} pixels exceeds the limit of {limits.max_pixels}", path)
    return codec, fps


def _source_frames(path: Path, limits: IngestLimits, deadline: float) -> int:
    n = _count_frames(path, limits, deadline)
    if n < 1:
        raise StudyError("video holds no frames", path)
    if n > limits.video_max_source_frames:
        raise StudyError(
            f"the video holds more than {limits.video_max_source_frames} frames (video_max_source_frames)", path
        )
    return n


def _decode_kept(
    path: Path, slot: dict[int, int], limits: IngestLimits, admit: Admit | None, deadline: float
) -> tuple[np.ndarray | None, list[int], int]:
    """Decode up to the last kept frame, each kept one (source index -> `slot`) into the display array, which
    the first kept frame sizes. Returns the array, the slots filled, and the frames decoded."""
    import av

    out: np.ndarray | None = None
    filled: list[int] = []
    decoded = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for index, frame in enumerate(container.decode(stream)):
            decoded += 1
            if index in slot:
                if out is None:  # sized by the first kept frame (a header may state none): before any copy
                    height, width = frame.height, frame.width
                    out = _allocate(len(slot), height, width, limits, admit, path)
                if (frame.height, frame.width) != (height, width):
                    raise StudyError(
                        f"inconsistent frame sizes in the video: {frame.height}x{frame.width} after {height}x{width}",
                        path,
                    )
                out[slot[index]] = luminance(frame.to_ndarray(format="rgb24"))
                filled.append(slot[index])
            if len(filled) == len(slot):
                break
            if decoded % 16 == 0:
                _check_deadline(deadline, limits, path)
    return out, filled, decoded
