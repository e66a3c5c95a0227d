"""Stored pixel values -> display values in [0, 1].

One function so that DICOM ingest, video ingest and the synthetic data generator all map pixels the same way:
a model trained on synthetic studies must see real studies through the identical transform.
"""

from __future__ import annotations

import numpy as np

# ITU-R BT.601 luma weights: what DICOM viewers and video codecs use for "grey from RGB".
_BT601 = np.array([0.299, 0.587, 0.114], dtype=np.float32)

_COLOUR_PHOTOMETRICS = {"RGB", "YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT", "PALETTE COLOR"}


def _is_rgb(arr: np.ndarray, photometric: str) -> bool:
    if arr.ndim < 2 or arr.shape[-1] != 3:
        return False
    # (n, H, W, 3) is unambiguous; (H, W, 3) counts as colour only when the photometric says so, since a
    # greyscale stack of 3-pixel-wide frames would look the same.
    return arr.ndim == 4 or photometric.upper() in _COLOUR_PHOTOMETRICS


def luminance(rgb: np.ndarray) -> np.ndarray:
    """(..., 3) RGB -> (...) float32 BT.601 luma."""
    return np.asarray(rgb).astype(np.float32, copy=False) @ _BT601


def to_display(
    stored: np.ndarray,
    *,
    slope: float = 1.0,
    intercept: float = 0.0,
    center: float | None = None,
    width: float | None = None,
    photometric: str = "MONOCHROME2",
) -> np.ndarray:
    """Map stored values to float32 display values in [0, 1] (same shape; a trailing RGB axis is dropped).

    Modality LUT (`stored * slope + intercept`), then the DICOM linear VOI function (PS3.3 C.11.2.1.2.1),
    or min-max over the whole array when no window is given. MONOCHROME1 is inverted after windowing.
    """
    arr = np.asarray(stored)
    photometric = (photometric or "MONOCHROME2").strip().upper()
    if _is_rgb(arr, photometric):
        arr = luminance(arr)
    x = arr.astype(np.float32, copy=True)
    if slope != 1.0:
        x *= np.float32(slope)
    if intercept != 0.0:
        x += np.float32(intercept)
    if not np.all(np.isfinite(x)):  # float pixel data can carry NaN/inf; they would poison min-max
        np.nan_to_num(x, copy=False, nan=0.0, posinf=0.0, neginf=0.0)

    if center is not None and width is not None:
        c = float(center)
        w = float(width)
        if w <= 1.0:
            # The standard's w == 1 case (and anything narrower) is a hard threshold at c - 0.5.
            y = (x > np.float32(c - 0.5)).astype(np.float32)
        else:
            y = (x - np.float32(c - 0.5)) / np.float32(w - 1.0) + np.float32(0.5)
            np.clip(y, 0.0, 1.0, out=y)
    else:
        y = x
        if y.size:
            lo = float(y.min())
            hi = float(y.max())
            if hi > lo:
                y -= np.float32(lo)
                y /= np.float32(hi - lo)
            else:
                y[...] = 0.0

    if photometric == "MONOCHROME1":
        y = np.float32(1.0) - y
    return y.astype(np.float32, copy=False)


def min_max_in_place(frames: np.ndarray) -> None:
    """`to_display`'s min-max without a window, in place on float32 values: for a whole study's array, which must
    not be copied (ingest's memory budget counts it once)."""
    if not frames.size:
        return
    lo, hi = float(frames.min()), float(frames.max())
    if hi > lo:
        frames -= np.float32(lo)
        frames /= np.float32(hi - lo)
    else:
        frames[...] = 0.0
