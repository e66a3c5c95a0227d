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

# What this thread is capturing: a stack of `Captured` (innermost last), and where `held_log_messages()` diverts
# pydicom's log warnings (None: to the innermost capture, as usual). Thread-local, so ingests run side by side: the
# guard no longer swaps process-wide warning state under a lock that serialised every ingest.
_TLS = threading.local()
# Warnings that ingest reports with a study, every time: pydicom's notes (UserWarning) and numpy's (RuntimeWarning:
# an overflow in a cast). Others (DeprecationWarning) keep Python's once-per-place default.
CAPTURED_CATEGORIES = (UserWarning, RuntimeWarning)
# Libraries whose log records quote element values: their messages are scrubbed whoever logs them.
THIRD_PARTY_LOGGERS = ("pydicom", "highdicom", "pynetdicom")


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
    """Rewrites each record's message through `scrub`; warnings go to this thread's capture as well, if any.

    Installed once, for good, on the libraries' loggers (`install`); outside a guarded section it still scrubs."""

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
            held = getattr(_TLS, "held", None)
            stack = getattr(_TLS, "stack", None)
            if held is not None:
                held.append(clean)
                return not getattr(_TLS, "held_quiet", False)
            if stack:
                stack[-1].logged.append(clean)
        return True


class ScrubExceptions(logging.Filter):
    """For a handler: the message line of any logged exception goes through `scrub` (a library's error text can
    quote a patient's name or date), the frames stay readable; records of `THIRD_PARTY_LOGGERS` are scrubbed whole,
    so a child logger (highdicom.sr.templates) is covered too."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".", 1)[0] in THIRD_PARTY_LOGGERS:
            try:
                message = record.getMessage()
            except Exception:
                message = str(record.msg)
            record.msg, record.args = scrub(message), None
        if record.exc_info and record.exc_info[0] is not None:
            import traceback

            lines = traceback.format_exception(*record.exc_info)
            text = "".join(line if line.startswith((" ", "Traceback")) else scrub(line) for line in lines)
            record.exc_text = text.rstrip("\n")
            record.exc_info = None
        return True


_FILTER = ScrubFilter()


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - warnings' API
    """The process's `warnings.showwarning`: into this thread's capture when it has one, else shown scrubbed."""
    stack = getattr(_TLS, "stack", None)
    if stack:
        stack[-1].raw.append(str(message))
        return
    clean = warnings.WarningMessage(scrub(str(message)), category, filename, lineno, file, line)
    # what the default showwarning (or a recording catch_warnings) does; private, so typeshed does not list it
    warnings._showwarnmsg_impl(clean)  # type: ignore[attr-defined]


def install() -> None:
    """Process-wide, idempotent: scrub the libraries' log records and every warning whoever raises it.

    Called at each guarded section too, because `warnings.catch_warnings()` (pytest wraps every test in one)
    restores the previous hook on exit, and libraries create child loggers as they are imported. Repeated warnings
    are always shown (a study's second slice with the same bad value still counts): a filter inserted once at the
    front, never a process-wide swap per call."""
    if warnings.showwarning is not _showwarning:
        warnings.showwarning = _showwarning
    front = {(f[0], f[2]) for f in warnings.filters[: len(CAPTURED_CATEGORIES)]}
    if front != {("always", c) for c in CAPTURED_CATEGORIES}:
        for category in CAPTURED_CATEGORIES:
            warnings.filterwarnings("always", category=category)
    names = [n for n in logging.Logger.manager.loggerDict if n.split(".", 1)[0] in THIRD_PARTY_LOGGERS]
    for name in {*THIRD_PARTY_LOGGERS, *names}:  # a filter holds for its own logger only, not its children
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def install_handlers(handlers: list[logging.Handler]) -> None:
    """Add `ScrubExceptions` to log handlers (the daemon's root handlers), so nothing reaches a log unscrubbed."""
    install()
    for handler in handlers:
        if not any(isinstance(f, ScrubExceptions) for f in handler.filters):
            handler.addFilter(ScrubExceptions())


@contextmanager
def held_log_messages(*, quiet: bool = False) -> Iterator[list[str]]:
    """Within `phi_guard`, keep this thread's pydicom log warnings (scrubbed) in the yielded list, not the guard's.

    For a reader that replaces pydicom's message with its own ("truncated inside its pixel data" for "End of
    file reached before delimiter"): it drops what it replaced and passes the rest on with `warnings.warn`.
    `quiet`: the records stop there, logged nowhere (an attempt whose failure the caller handles in full).
    """
    previous = getattr(_TLS, "held", None), getattr(_TLS, "held_quiet", False)
    held: list[str] = []
    _TLS.held, _TLS.held_quiet = held, quiet
    try:
        yield held
    finally:
        _TLS.held, _TLS.held_quiet = previous


class Captured:
    """What a guarded section produced: `raw` warning texts (only ever scrubbed before they leave), scrubbed log
    records, and `messages`, both scrubbed, once the section ends."""

    def __init__(self) -> None:
        self.raw: list[str] = []
        self.logged: list[str] = []
        self.messages: list[str] = []

    def unique(self, limit: int = 20) -> list[str]:
        seen: list[str] = []
        for m in self.messages:
            if m not in seen:
                seen.append(m)
        return seen[:limit]


@contextmanager
def captured_warnings() -> Iterator[Captured]:
    """This thread's warnings and library log warnings in the yielded `Captured`, nothing shown; no lock, no
    process-wide state swapped (see `install`)."""
    install()
    captured = Captured()
    stack = getattr(_TLS, "stack", None)
    if stack is None:
        stack = _TLS.stack = []
    stack.append(captured)
    try:
        yield captured
    finally:
        stack.remove(captured)


@contextmanager
def phi_guard() -> Iterator[Captured]:
    """Run a block with warnings captured and pydicom's log records scrubbed; yields the scrubbed messages.

    Captured warnings are not re-raised: the caller reports them (e.g. in `Study.warnings`) where it chooses.
    """
    with captured_warnings() as captured:
        try:
            yield captured
        finally:
            # pydicom's warn_and_log() sends each message down both channels: keep one copy.
            for w in captured.raw:
                captured.messages.append(scrub(w))
            for m in captured.logged:
                if m not in captured.messages:
                    captured.messages.append(m)
