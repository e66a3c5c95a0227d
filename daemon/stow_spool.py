"""A STOW-RS body onto disk as it arrives, and where each of its parts lies in it.

A `multipart/related` body can be as large as the upload limit (hundreds of MB); read whole it was held in memory
with a copy of every part. Here it is written chunk by chunk to one anonymous file (`O_TMPFILE` where the file
system has it: no name, so nothing is left behind by any exit, a crash or a kill included) while `PartFinder`
finds the delimiters incrementally; memory holds a chunk, a write buffer and the parts' offsets. The parts are
then read back one at a time (`SpooledBody.read`).

The framing rules are RFC 2046's, as the splitter before this one applied them: the preamble is skipped up to the
first delimiter, a part runs from the line after its delimiter to the CRLF before the next one, `--` after a
delimiter closes the body (the epilogue is ignored), and a body that ends inside a part keeps that part, marked,
so that the parts before it are still stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from starlette.requests import ClientDisconnect

from edgekit.errors import EdgekitError

from .uploads import storage_error

log = logging.getLogger("edgekitd")

MAX_PARTS = 10000
WRITE_BYTES = 1 << 20  # received bytes are written to the spool file in batches of about this much, off the loop
ENDS_INSIDE = "the body ends inside this part"


class MultipartError(EdgekitError):
    code = "invalid_multipart"


class ClientGoneError(EdgekitError):
    """The client disconnected before the body ended: nothing is stored and nobody reads the answer; the status is
    nginx's "client closed request", so the access log and the request metrics tell it from a refusal."""

    code = "client_disconnected"
    http_status = 499


@dataclass(frozen=True)
class Span:
    """One part: its bytes (headers, blank line, content) are body[start:end]; `problem` a framing problem."""

    start: int
    end: int
    problem: str | None = None


_PREAMBLE, _DELIMITER, _LINE_END, _PART, _CLOSED = range(5)


class PartFinder:
    """Finds the parts of a multipart body fed in pieces of any size, as offsets into the whole body.

    It keeps only the few bytes at a piece's end that may begin a delimiter, so memory does not grow with the
    body; the result does not depend on how the body was cut into pieces."""

    def __init__(self, boundary: bytes):
        self.delimiter = b"--" + boundary
        self.next_part = b"\r\n" + self.delimiter
        self.spans: list[Span] = []
        self.size = 0  # bytes fed so far
        self._state = _PREAMBLE
        self._tail = b""  # the unsearched end of what was fed, starting at offset size - len(_tail)
        self._start = 0  # where the current part starts

    @property
    def closed(self) -> bool:
        """The close delimiter was seen: what follows is the epilogue."""
        return self._state == _CLOSED

    def feed(self, piece: bytes) -> None:
        buf = self._tail + piece
        base = self.size - len(self._tail)  # the body offset of buf[0]
        self.size += len(piece)
        i, keep = 0, 0  # i: where searching goes on; keep: bytes at buf's end that may start what is sought
        while self._state != _CLOSED:
            if self._state == _PREAMBLE:
                j = buf.find(self.delimiter, i)
                if j < 0:
                    keep = len(self.delimiter) - 1
                    break
                i, self._state = j + len(self.delimiter), _DELIMITER
            elif self._state == _DELIMITER:
                if len(buf) - i < 2:
                    keep = len(buf) - i
                    break
                self._state = _CLOSED if buf.startswith(b"--", i) else _LINE_END
            elif self._state == _LINE_END:  # anything up to the line end after a delimiter is padding
                j = buf.find(b"\r\n", i)
                if j < 0:
                    keep = 1
                    break
                i, self._state = j + 2, _PART
                self._start = base + i
            else:  # _PART
                j = buf.find(self.next_part, i)
                if j < 0:
                    keep = len(self.next_part) - 1
                    break
                self._add(Span(self._start, base + j))
                i, self._state = j + len(self.next_part), _DELIMITER
        self._tail = buf[max(i, len(buf) - keep) :] if self._state != _CLOSED else b""

    def finish(self) -> list[Span]:
        """The parts of the whole body, or the error that refuses it."""
        if self._state == _PREAMBLE:
            raise MultipartError("the body holds no part (the boundary never appears)")
        if self._state == _PART:
            self._add(Span(self._start, self.size, ENDS_INSIDE))
        if not self.spans:
            raise MultipartError("the body holds no part")
        return self.spans

    def _add(self, span: Span) -> None:
        self.spans.append(span)
        if len(self.spans) > MAX_PARTS:
            raise MultipartError(f"more than {MAX_PARTS} parts in one request")


class SpooledBody:
    """The spooled body: read back one part at a time (blocking: in a thread), then closed (the file goes)."""

    def __init__(self, file: IO[bytes]):
        self.file = file
        self.spans: list[Span] = []

    def read(self, span: Span) -> bytes:
        self.file.seek(span.start)
        return self.file.read(span.end - span.start)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a flush that fails on a full disk: the file is closed all the same
            self.file.close()


def _open(folder: Path) -> SpooledBody:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return SpooledBody(tempfile.TemporaryFile(dir=folder, prefix=".stow-"))


async def spool(chunks: AsyncGenerator[bytes, None], boundary: bytes, folder: Path) -> SpooledBody:
    """Read the body to its end into an anonymous file under `folder` (created 0700), finding its parts on the
    way. Reading is async; file work runs in a thread. On any error (a framing error, the upload limit, the
    client gone) the file is closed before the error goes on."""
    try:
        body = await asyncio.to_thread(_open, folder)
    except OSError as err:
        raise storage_error(err) from None
    finder = PartFinder(boundary)
    pending: list[bytes] = []
    buffered = received = 0
    try:
        async with contextlib.aclosing(chunks) as stream:
            async for chunk in stream:
                received += len(chunk)
                if finder.closed:  # the epilogue is read (the upload limit still counts it) but not kept
                    continue
                finder.feed(chunk)
                pending.append(chunk)
                buffered += len(chunk)
                if buffered >= WRITE_BYTES:
                    await asyncio.to_thread(_write, body.file, pending)
                    pending, buffered = [], 0
        await asyncio.to_thread(_write, body.file, pending)
        body.spans = finder.finish()
    except ClientDisconnect:
        body.close()
        log.info("stow-rs: client disconnected after %d bytes", received)
        raise ClientGoneError("the client disconnected before the body ended") from None
    except OSError as err:
        body.close()
        raise storage_error(err) from None
    except BaseException:  # a refused body, the upload limit, a cancelled request
        body.close()
        raise
    return body


def _write(file: IO[bytes], pieces: list[bytes]) -> None:
    file.writelines(pieces)
    file.flush()
