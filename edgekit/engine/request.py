"""One generation request as the engine holds it, and the ticket its caller waits on."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from edgekit.errors import EdgekitError

from .sequence import GenerationOptions, GenerationResult, OnToken


# what a request can be refused with at `Engine.submit` (503: the caller may come back)
class EngineBusyError(EdgekitError):
    """More requests waiting than the engine takes: the caller should retry later."""

    code = "engine_busy"
    http_status = 503


class KVBudgetError(EdgekitError):
    """A request whose KV cache alone would exceed the engine's budget: it cannot run here as configured."""

    code = "kv_budget_exceeded"
    http_status = 503


@dataclass(eq=False)
class Request:
    """`prompt_ids` (seq,) without padding; `pixel_values` (frames, 1, H, W) or None for a text-only request; the
    image goes before prompt token `image_slot`. `on_token(token_id, index)` sees each kept token as it is chosen
    (called on the engine's thread: keep it short)."""

    prompt_ids: np.ndarray
    options: GenerationOptions
    pixel_values: np.ndarray | None = None
    image_slot: int = 0
    on_token: OnToken | None = None
    cancel: threading.Event | None = None  # set by the caller (a client gone, a timeout): ends it at the next step

    def __post_init__(self) -> None:
        ids = np.asarray(self.prompt_ids, np.int64)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.size == 0:
            raise EdgekitError(f"prompt_ids must be one non-empty sequence, got shape {np.shape(self.prompt_ids)}")
        self.prompt_ids = ids
        if self.pixel_values is not None:
            pv = np.asarray(self.pixel_values, np.float32)
            if pv.ndim == 5 and pv.shape[0] == 1:
                pv = pv[0]
            if pv.ndim != 4:
                raise EdgekitError(f"pixel_values must be (frames, 1, H, W), got shape {np.shape(self.pixel_values)}")
            self.pixel_values = pv
        self.options.validate()


class Cancelled(EdgekitError):
    code = "cancelled"
    http_status = 499


@dataclass(eq=False)
class Ticket:
    """A submitted request: `result()` waits for it, `cancel()` ends it at the next step (its tokens so far are
    kept, stop reason `cancelled`)."""

    request: Request
    submitted: float = field(default_factory=time.perf_counter)
    _done: threading.Event = field(default_factory=threading.Event)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _result: GenerationResult | None = None
    _error: BaseException | None = None

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        outside = self.request.cancel
        return self._cancel.is_set() or (outside is not None and outside.is_set())

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # the engine's side -------------------------------------------------------------------------------------
    def _finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()
