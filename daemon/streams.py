"""Token streams: report text as it is generated, from a model worker thread to any number of HTTP readers.

The worker turns token ids into text deltas (`TextDeltas`) and appends them to the job's `TokenStream`; readers on
the event loop replay what they missed and then wait, woken thread-safely. The deltas are cut so that joined they
are exactly the final report text (`Reporter` strips the decoded text; so do the deltas, holding back whitespace and
half-decoded characters until the next token shows what they become). Streams live in memory: finished ones are
kept for the last `keep_finished` jobs, older or pre-restart jobs replay their text as one delta.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"  # what a byte-level decoder shows for an unfinished UTF-8 sequence


class TextDeltas:
    """Token ids in, text deltas out: each delta extends the stripped decoded text seen so far."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).strip()
        if text.endswith(REPLACEMENT) or not text.startswith(self.sent):
            return ""  # wait: the next token decides what these bytes mean
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self, final_text: str) -> str:
        """Whatever the final text has beyond what was sent (normally nothing)."""
        if final_text.startswith(self.sent):
            delta, self.sent = final_text[len(self.sent) :], final_text
            return delta
        return ""


class TokenStream:
    """Append-only text deltas of one report plus a done flag; readers keep their own cursor."""

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.done = False
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def push(self, delta: str) -> None:
        if delta:
            with self._lock:
                self.deltas.append(delta)
            self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that reader's loop is gone
                pass

    async def wait(self, timeout: float) -> None:
        """Until the next push/close or `timeout` seconds, whichever is first (readers also poll job state)."""
        event = asyncio.Event()
        key = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.add(key)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(key)

    def since(self, cursor: int) -> list[str]:
        with self._lock:
            return self.deltas[cursor:]


class StreamHub:
    """job id -> TokenStream; finished streams beyond `keep_finished` are forgotten, oldest first."""

    def __init__(self, keep_finished: int = 256):
        self.keep_finished = keep_finished
        self._streams: OrderedDict[str, TokenStream] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, key: str) -> TokenStream:
        with self._lock:
            stream = self._streams[key] = TokenStream()  # a rerun (after a restart) starts from scratch
            self._streams.move_to_end(key)
            finished = [k for k, s in self._streams.items() if s.done]
            for k in finished[: max(0, len(finished) - self.keep_finished)]:
                del self._streams[k]
            return stream

    def get(self, key: str) -> TokenStream | None:
        with self._lock:
            return self._streams.get(key)


def token_sink(
    tokenizer: Tokenizer, stream: TokenStream
) -> tuple[Callable[[int, int], None], Callable[[str | None], None]]:
    """An `on_token` callback for `Reporter.report` that feeds `stream`, plus a `finish(text)` to close it."""
    deltas = TextDeltas(tokenizer)

    def on_token(token_id: int, _index: int) -> None:
        stream.push(deltas.push(token_id))

    def finish(final_text: str | None) -> None:
        if final_text is not None:
            stream.push(deltas.finish(final_text))
        stream.close()

    return on_token, finish
