"""Video files (cine loops exported as MP4 and the like) -> a `Study` of evenly spaced frames.

Only the frames that will be kept are converted, so a long clip costs a decode pass but not its memory. The study
records the `video_max_frames` it was sampled with: below the model's own frame count that is frame skipping, and
the reporter then feeds the vision encoder that many frames instead of repeating them (fewer frames, less work).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from edgekit.errors import StudyError
from edgekit.ingest.phi import hash_bytes, scrub
from edgekit.ingest.pixels import luminance, to_display
from edgekit.ingest.study import IngestLimits, Study
from edgekit.preprocess import sample_indices

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _count_frames(path: Path) -> int:
    """Frames in the first video stream: the header's count if it has one, else packets demuxed (no decode)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.frames and stream.frames > 0:
            return int(stream.frames)
        return sum(1 for packet in container.demux(stream) if packet.size)


def load_video(path: Path, limits: IngestLimits) -> Study:
    """Decode a video, keeping at most `limits.video_max_frames` evenly spaced frames as display values."""
    import av  # imported here: PyAV is heavy and only video ingest needs it

    warnings: list[str] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise StudyError("no video stream in the file", path)
            stream = container.streams.video[0]
            codec = stream.codec_context.name
            fps = float(stream.average_rate) if stream.average_rate else None
            width, height = stream.codec_context.width, stream.codec_context.height
        if width and height and width * height > limits.max_pixels:
            raise StudyError(f"frame of {height}x{width} pixels exceeds the limit of {limits.max_pixels}", path)
        n = _count_frames(path)
        if n < 1:
            raise StudyError("video holds no frames", path)
        keep = limits.video_max_frames
        wanted = sample_indices(n, keep).tolist() if n > keep else list(range(n))
        wanted_set = set(wanted)
        kept: dict[int, np.ndarray] = {}
        decoded = 0
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            for index, frame in enumerate(container.decode(stream)):
                decoded += 1
                if index in wanted_set:
                    rgb = frame.to_ndarray(format="rgb24")
                    if rgb.shape[0] * rgb.shape[1] > limits.max_pixels:
                        raise StudyError(f"frame of {rgb.shape[0]}x{rgb.shape[1]} pixels exceeds the limit", path)
                    kept[index] = luminance(rgb)
                if len(kept) == len(wanted_set):
                    break
    except StudyError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, OSError, EOFError) as err:
        detail = getattr(err, "strerror", None) or str(err)[:200]  # FFmpeg's text without errno or path
        raise StudyError(f"undecodable video ({type(err).__name__}: {scrub(detail)})", path) from None
    if not kept:
        raise StudyError("undecodable video: no frame could be decoded", path)
    if len(kept) < len(wanted_set):
        warnings.append(f"video held {decoded} decodable frames, not the {n} its header announced")
    order = sorted(kept)
    shapes = {kept[i].shape for i in order}
    if len(shapes) > 1:
        raise StudyError(f"inconsistent frame sizes in the video: {sorted(shapes)}", path)
    stack = np.stack([kept[i] for i in order])
    frames = to_display(stack)  # min-max over the kept frames, as for a DICOM series without a window
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
