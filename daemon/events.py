"""The two event streams: a synchronous report's tokens, and a durable job's states and tokens.

Both are async generators read by `StreamingResponse` after the status line has gone, so a failure arrives as an
`error` event rather than an HTTP status. Token deltas joined are exactly the report's text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from edgekit.errors import EdgekitError

from .jobs import TERMINAL, JobStore
from .responses import StreamFormat, event
from .streams import StreamHub, TokenStream
from .work import Work

INTERNAL = {"code": "internal_error", "message": "internal error; the daemon logged it"}


async def report_events(work: Work, stream: TokenStream, fmt: StreamFormat, timeout_s: float) -> AsyncIterator[str]:
    """`token` events, then one `report` event (or an `error` event)."""
    cursor = 0
    deadline = time.monotonic() + timeout_s
    try:
        while not work.future.done() and time.monotonic() < deadline:
            for delta in stream.since(cursor):
                yield event(fmt, {"event": "token", "index": cursor, "text": delta})
                cursor += 1
            await stream.wait(0.25)
    finally:
        if not work.future.done() and work.job_id is None:  # the reader left, or its time ran out: stop decoding
            work.cancel.set()
    for delta in stream.since(cursor):
        yield event(fmt, {"event": "token", "index": cursor, "text": delta})
        cursor += 1
    if not work.future.done():
        yield event(fmt, {"event": "error", "error": {"code": "timeout", "message": "no report in time"}})
        return
    err = work.future.exception()
    if isinstance(err, EdgekitError):
        yield event(fmt, {"event": "error", "status": err.http_status, "error": err.to_json()})
    elif err is not None:
        yield event(fmt, {"event": "error", "status": 500, "error": INTERNAL})
    else:
        yield event(fmt, {"event": "report", "report": work.future.result()})


async def job_events(job_id: str, store: JobStore, streams: StreamHub, fmt: StreamFormat) -> AsyncIterator[str]:
    """`state` events as the job moves, a `token` event per text delta, and the final state with the report.
    A job no longer streamed from memory (finished long ago, or before a restart) replays its text as one delta."""
    last, cursor = None, 0
    while True:
        stream = streams.get(job_id)
        seen = len(stream.since(0)) if stream is not None else 0  # before the state: tokens imply running
        job = await asyncio.to_thread(store.get, job_id)
        if job is None:
            return
        if job.state in TERMINAL:
            rest = stream.since(cursor) if stream is not None else []
            if stream is None and cursor == 0 and job.result:
                rest = [job.result["text"]]
            for delta in rest:
                yield event(fmt, {"event": "token", "index": cursor, "text": delta})
                cursor += 1
            yield event(fmt, {"event": "state", **job.public()})
            return
        if job.state != last:
            last = job.state
            yield event(fmt, {"event": "state", **job.public()})
        if stream is not None:
            for delta in stream.since(cursor)[: seen - cursor]:
                yield event(fmt, {"event": "token", "index": cursor, "text": delta})
                cursor += 1
            await stream.wait(0.25)
        else:
            await asyncio.sleep(0.1)
