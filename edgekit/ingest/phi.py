"""Keep patient data out of logs, warnings and error messages.

pydicom's validation warnings and log records quote raw element values ("Invalid value for VR DA: '19700101'"),
so a study's name, ID or dates could leak into a server log. Ingest runs inside `phi_guard()`, which captures both
channels, redacts every quoted value and hands back scrubbed messages. Studies are referred to by `hash_uid`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

REDACTED = "<redacted>"

# Quoted strings ('..', "..", b'..'), which is how pydicom embeds element values in its messages.
_QUOTED = re.compile(r"""b?'(?:[^'\\]|\\.)*'|b?"(?:[^"\\]|\\.)*\"""")
# Digit runs that look like dates/times or IDs (8+ digits, or with date separators) outside quotes.
_DATELIKE = re.compile(r"\b\d{4}[-./]?\d{2}[-./]?\d{2}(?:\d{2,6}(?:\.\d+)?)?\b")
_LONG_NUMBER = re.compile(r"\b\d{8,}\b")
# File paths ("... found in file /exports/DOE_JOHN/IM0007.dcm"): folder and file names of real exports carry
# patient names. An absolute POSIX or Windows path with at least one separator inside it.
_PATH = re.compile(r"(?<![\w.:/\\])(?:[A-Za-z]:)?[/\\](?:[^\s/\\'\"]+[/\\])+[^\s/\\'\",;)]*")

# catch_warnings() swaps process-wide state; serialise guarded sections so two threads cannot interleave them.
_LOCK = threading.RLock()
# Where `held_log_messages()` diverts this thread's pydicom log messages (None: to the guard, as usual).
_HELD = threading.local()


def hash_uid(uid: str | bytes | None) -> str:
    """A stable, non-reversible handle for a UID (or any identifying string): `uid:` + 16 hex of sha256."""
    if uid is None:
        uid = ""
    if isinstance(uid, bytes):
        uid = uid.decode("ascii", "replace")
    text = str(uid).strip().rstrip("\x00").strip()
    return "uid:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def hash_bytes(data_sha256: str) -> str:
    """Same handle format for a study identified by its content (a video file's sha256 hex digest)."""
    return "uid:" + data_sha256[:16]


def scrub(text: str, known_values: tuple[str, ...] = ()) -> str:
    """Redact quoted values, file paths, date-like numbers, long digit runs and any `known_values` from a message.

    Longer known values go first, so a path is redacted whole before its file name could be matched inside it.
    """
    out = str(text)
    for value in sorted((str(v).strip() for v in known_values), key=len, reverse=True):
        if len(value) >= 2:
            out = out.replace(value, REDACTED)
    out = _PATH.sub(REDACTED, out)
    out = _QUOTED.sub(f"'{REDACTED}'", out)
    out = _DATELIKE.sub(REDACTED, out)
    out = _LONG_NUMBER.sub(REDACTED, out)
    return out


class ScrubFilter(logging.Filter):
    """A logging filter that rewrites each record's message through `scrub` (and keeps a copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: drop its arguments rather than risk printing them
            message = str(record.msg)
        clean = scrub(message)
        record.msg = clean
        record.args = None
        record.exc_info = None  # exception text can carry element values too
        record.exc_text = None
        if record.levelno >= logging.WARNING:
            held = getattr(_HELD, "messages", None)
            (held if held is not None else self.messages).append(clean)
        return True


@contextmanager
def held_log_messages() -> Iterator[list[str]]:
    """Within `phi_guard`, keep this thread's pydicom log warnings (scrubbed) in the yielded list, not the guard's.

    For a reader that replaces pydicom's message with its own ("truncated inside its pixel data" for "End of
    file reached before delimiter"): it drops what it replaced and passes the rest on with `warnings.warn`.
    """
    previous = getattr(_HELD, "messages", None)
    _HELD.messages = held = []
    try:
        yield held
    finally:
        _HELD.messages = previous


def _pydicom_loggers() -> list[logging.Logger]:
    names = ["pydicom"] + [n for n in logging.Logger.manager.loggerDict if n.startswith("pydicom.")]
    return [logging.getLogger(n) for n in names]


class Captured:
    """What a guarded section produced, already scrubbed: pydicom warnings and warning-level log records."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def unique(self, limit: int = 20) -> list[str]:
        seen: list[str] = []
        for m in self.messages:
            if m not in seen:
                seen.append(m)
        return seen[:limit]


@contextmanager
def phi_guard() -> Iterator[Captured]:
    """Run a block with warnings captured and pydicom's log records scrubbed; yields the scrubbed messages.

    Captured warnings are not re-raised: the caller reports them (e.g. in `Study.warnings`) where it chooses.
    """
    captured = Captured()
    log_filter = ScrubFilter()
    with _LOCK:
        loggers = _pydicom_loggers()
        for lg in loggers:
            lg.addFilter(log_filter)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield captured
        finally:
            for lg in loggers:
                lg.removeFilter(log_filter)
            # pydicom's warn_and_log() sends each message down both channels: keep one copy.
            for w in caught:
                captured.messages.append(scrub(str(w.message)))
            for m in log_filter.messages:
                if m not in captured.messages:
                    captured.messages.append(m)
