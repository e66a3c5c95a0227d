"""The one memory budget for ingest: what a study will cost, worked out from its headers before a pixel is decoded.

Decode writes the display frames (float32) into one array allocated up front and works frame by frame, so a study
costs its output frames, one frame's working set (the decoder's buffer, the stored frame, float copies for the
modality LUT, luminance and window) and the encoded object held while it decodes. A study whose cost is over
`IngestLimits.memory_bytes` is refused with that figure, cheaply; a study inside it never costs more. The daemon
also hands the cost to its process-wide pool (`admit`), so studies waiting in its queue are counted too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from edgekit.errors import StudyTooLargeError
from edgekit.ingest.study import IngestLimits

DISPLAY_BYTES = 4  # float32 display values, one per pixel (colour becomes luminance)
# A Deflated object is inflated before it is parsed, and pydicom copies the element values out of that buffer:
# its inflated size may be at most this share of the budget, so inflating and parsing it stay inside the budget.
DEFLATE_SHARE = 4

# pydicom's Python objects per parsed element, above its value: measured 430-650 bytes on the CT sample's headers
# (raw, then converted), 1.3 KiB inside nested sequence items
ELEMENT_BYTES = 1024

Admit = Callable[[int], None]  # told a study's cost before it decodes; raises to refuse it (the daemon's pool)


def mib(n: int) -> str:
    """Bytes for a reader: MiB, or KiB below one MiB (a small budget still says something)."""
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def frame_working_bytes(rows: int, columns: int, samples: int, bits_allocated: int) -> int:
    """Bytes one frame needs while it becomes display values: the decoder's output and our copy of it, then up to
    three float32 planes (a colour frame's luminance is computed from a float32 copy of all three samples)."""
    pixels = rows * columns
    stored = pixels * samples * max(1, (bits_allocated + 7) // 8)
    return 2 * stored + pixels * DISPLAY_BYTES * max(3, samples + 1)


def header_bytes(ds: Any, skip: tuple[int, ...] = ()) -> int:
    """What a parsed header holds in memory: ELEMENT_BYTES per element plus its binary value (a private 4 MiB OB
    element counts), through sequence items; the tags in `skip` (the pixel data, costed on its own) count as an
    element only. Reads raw elements as they are (`Dataset.elements()`), converting none."""
    total = 0
    for elem in ds.elements():
        total += ELEMENT_BYTES
        if elem.tag in skip:
            continue
        value = elem.value
        if isinstance(value, (bytes, bytearray)):
            total += len(value)
        elif isinstance(value, Iterable) and not isinstance(value, str):
            total += sum(header_bytes(item) for item in value if hasattr(item, "elements"))
    return total


def display_bytes(frames: int, rows: int, columns: int) -> int:
    return frames * rows * columns * DISPLAY_BYTES


def check(cost: int, limits: IngestLimits, label: str | Path, what: str = "decoding this study") -> None:
    """Refuse a study whose cost is over the budget, naming both figures."""
    if cost > limits.memory_bytes:
        raise StudyTooLargeError(
            f"{what} needs about {mib(cost)}, over the ingest memory budget of {mib(limits.memory_bytes)} "
            "([limits] ingest_memory_bytes)",
            label,
        )


def inflate_limit(limits: IngestLimits | None) -> int:
    """The most a Deflated object may inflate to (see DEFLATE_SHARE)."""
    return (limits or IngestLimits()).memory_bytes // DEFLATE_SHARE
