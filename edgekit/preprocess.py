"""Display frames -> model input tensor.

Kept apart from ingest and free of torch so that training, export parity checks, the CLI and the daemon all feed
the model bit-identical inputs from the same `preprocessor_config.json`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from edgekit.errors import ConfigError

CONFIG_NAME = "preprocessor_config.json"


@dataclass(frozen=True)
class PreprocessConfig:
    """How a study becomes `pixel_values`: frame count, square size and normalisation."""

    image_size: int = 64
    num_frames: int = 8
    mean: float = 0.5
    std: float = 0.5

    def __post_init__(self) -> None:
        for name in ("image_size", "num_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if self.std <= 0:
            raise ConfigError(f"std must be > 0, got {self.std!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, path: str | Path | None = None) -> PreprocessConfig:
        """Build from a dict; unknown keys are ignored (other tools add their own to this file)."""
        if not isinstance(data, dict):
            raise ConfigError("preprocessor config must be a JSON object", path)
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except ConfigError as err:
            raise ConfigError(err.reason, path) from None

    @classmethod
    def load(cls, path: str | Path) -> PreprocessConfig:
        """Read a `preprocessor_config.json` file, or the one inside a directory."""
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_NAME
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError("file not found", path) from None
        except OSError as err:
            raise ConfigError(f"cannot read: {err.strerror}", path) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"not valid JSON (line {err.lineno}: {err.msg})", path) from None
        return cls.from_dict(data, path=path)

    def save(self, path: str | Path) -> Path:
        """Write as JSON (atomically); a directory gets `preprocessor_config.json` inside it."""
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def sample_indices(n: int, num_frames: int) -> np.ndarray:
    """Output frame i takes input frame floor((i + 0.5) * n / num_frames): evenly spaced, centred picks."""
    if n < 1:
        raise ValueError("cannot sample frames from an empty study")
    i = np.arange(num_frames, dtype=np.int64)
    # Integer arithmetic: floor((2i + 1) * n / (2 * num_frames)) has no float rounding to disagree about.
    return ((2 * i + 1) * n) // (2 * num_frames)


def _resize(frame: np.ndarray, size: int) -> np.ndarray:
    if frame.shape == (size, size):
        return frame.astype(np.float32, copy=False)
    img = Image.fromarray(np.ascontiguousarray(frame, dtype=np.float32))  # mode "F"
    return np.asarray(img.resize((size, size), Image.Resampling.BOX), dtype=np.float32)


def preprocess_frames(frames: np.ndarray, cfg: PreprocessConfig | None = None) -> np.ndarray:
    """Display frames (n, H, W) or (H, W) in [0, 1] -> float32 (num_frames, 1, S, S), normalised.

    Frames are sampled (or repeated) to `num_frames`, each resized to S x S with Pillow's BOX filter in mode
    "F", then `(x - mean) / std`. A batch for the model is `out[None]`.
    """
    cfg = cfg or PreprocessConfig()
    arr = np.asarray(frames)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[0] < 1 or arr.shape[1] < 1 or arr.shape[2] < 1:
        raise ValueError(f"frames must have shape (n, H, W) with n, H, W >= 1, got {arr.shape}")
    idx = sample_indices(arr.shape[0], cfg.num_frames)
    size = cfg.image_size
    out = np.empty((cfg.num_frames, 1, size, size), dtype=np.float32)
    resized: dict[int, np.ndarray] = {}
    for i, j in enumerate(idx.tolist()):
        if j not in resized:  # a short study repeats frames: resize each source frame once
            resized[j] = _resize(arr[j], size)
        out[i, 0] = resized[j]
    out -= np.float32(cfg.mean)
    out /= np.float32(cfg.std)
    return out
