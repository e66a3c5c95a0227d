"""Cine loops as MP4, the form a clinic's ultrasound cart exports and `edgekit report clip.mp4` accepts.

PyAV with FFmpeg's native `mpeg4` encoder (LGPL; libx264 would make the wheel GPL). Single-threaded and without
B-frames, so the file is the same bytes on every run and decodes to exactly one picture per input frame.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

BIT_RATE = 1_500_000  # ample for 128x128 greyscale: keeps the loop visually lossless


def write_mp4(frames: np.ndarray, path: str | Path, fps: float) -> Path:
    """Encode uint8 greyscale frames (n, H, W) (even H and W) as an MPEG-4 Part 2 video in an MP4 container."""
    frames = np.asarray(frames)
    if frames.ndim != 3 or frames.dtype != np.uint8:
        raise ValueError("frames must be uint8 (n, H, W)")
    n, h, w = frames.shape
    if h % 2 or w % 2:
        raise ValueError("yuv420p needs even frame sizes")
    path = Path(path)
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = w, h
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = BIT_RATE
        stream.codec_context.thread_count = 1
        stream.codec_context.max_b_frames = 0
        stream.codec_context.gop_size = 12
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(frames[i], format="gray").reformat(format="yuv420p")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_mp4_gray(path: str | Path) -> np.ndarray:
    """Decode an MP4 back to uint8 (n, H, W) luma (what tests and the samples check)."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="gray") for f in container.decode(video=0)])
