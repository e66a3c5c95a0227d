"""The one decoding loop: continuous batching over a target's rows of KV cache.

Requests join at their prefill and leave at their stop token, their cap or a cancel; between, every row that is
decoding advances by one token in one shared backend step. What a step does, in order (vLLM's order: decoding rows
first, so a long prompt does not stall them):

1. admit waiting requests while rows, the batch-size limit (`control`) and the KV budget allow; encode the new
   requests' images together (one vision call for all of the same shape) and lay out their prompts;
2. one decode step for all decoding rows, each sampled with its own options and seed; where the backend runs
   several greedy steps in one call (`decode_greedy`) and nothing else needs the engine between them (no prompt
   prefilling, every row greedy), up to `GREEDY_RUN_STEPS` of them (`_greedy_run`);
3. one prefill chunk (`prefill_chunk` tokens; the whole prompt when None) for the oldest prefilling request; where
   the backend prefills several new rows in one call (`prefill_rows`), the first prompts of the same length and
   positions waiting beside it go with it (`_prefill_group`).

A request alone in the engine runs exactly the calls the old per-request loop made (prefill, then one decode per
token), so its tokens are unchanged; with others beside it, the decoder sees the same positions and cache per row.
The engine is driven either by `run()` in the caller's thread (`edgekit.generate.generate`, the CLI) or by its own
thread (`start()`: edgekitd, `edgekit eval`); only the driving thread touches the backend.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from edgekit.errors import EdgekitError
from edgekit.positions import PositionScheme

from .control import BatchController, FixedBatch, StepStats
from .request import EngineBusyError, KVBudgetError, Request, Ticket
from .rows import EngineRow, shared_prefill
from .sequence import GenerationResult, Timings, next_tokens, place_image
from .slots import as_slots, kv_bytes_per_token

IDLE_EXIT_S = 10.0  # a started engine's thread ends after this long with nothing to do (`submit` starts another)
# A greedy multi-step run (`Engine._greedy_run`): at most this many steps, and no step started after this long. At
# radreport-tiny's 0.15 ms token the engine's own Python was 20 us of each step; run together, the steps pay it once
GREEDY_RUN_STEPS = 32
GREEDY_RUN_S = 0.02
# First prompts prefilled together (`Engine._prefill_group`) hold at most this many tokens in all while other rows
# decode (`prefill_chunk` instead when it is set): their next token waits for the call, as it waits for one prompt's
# prefill when prompts go one at a time. With no row decoding, nothing waits: the rows bound the group. radreport-
# tiny's eight 32-token prompts: 8.2 ms in one call against 12.3 ms one by one, and rows that start together decode
# at one length (ORT's attention: faster)
PREFILL_BATCH_TOKENS = 512


class Engine:
    """Continuous batching over one backend (any target's run side; `slots.as_slots` adapts the older protocol).

    `max_batch` bounds the rows decoding together; `controller` may lower it step by step (`control`).
    `kv_budget_bytes` bounds the KV cache the admitted requests may reach (prompt + image + max_new_tokens each);
    a request waits until it fits, and one that could never fit is refused. `max_waiting` bounds the queue
    (None: unbounded). `image_tokens` is what one image adds to a prompt (for the budget). `greedy_run_steps`
    bounds a multi-step greedy run (1: one backend call per step)."""

    def __init__(
        self,
        backend,
        *,
        positions: PositionScheme | None = None,
        max_batch: int = 8,
        prefill_chunk: int | None = None,
        kv_budget_bytes: int | None = None,
        controller: BatchController | None = None,
        max_waiting: int | None = None,
        image_tokens: int = 0,
        greedy_run_steps: int = GREEDY_RUN_STEPS,
    ):
        if max_batch < 1:
            raise EdgekitError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise EdgekitError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if greedy_run_steps < 1:
            raise EdgekitError(f"greedy_run_steps must be >= 1, got {greedy_run_steps}")
        self.backend = backend
        self.slots = as_slots(backend, max_batch)
        self.max_batch = min(max_batch, self.slots.max_rows)
        self.scheme = positions or PositionScheme()
        self.prefill_chunk = prefill_chunk
        self.kv_budget = kv_budget_bytes
        self.kv_per_token = kv_bytes_per_token(self.slots)
        self.controller = controller or FixedBatch(self.max_batch)
        self.row_cap: int | None = None  # a cap set while running (`cap_rows`): a policy point's batch size
        self.max_waiting = max_waiting
        self.image_tokens = image_tokens
        self.greedy_run_steps = greedy_run_steps
        self._waiting: deque[Ticket] = deque()
        self._lock = threading.Condition()
        self._free_rows = list(range(self.max_batch))
        self._prefilling: deque[EngineRow] = deque()
        self._decoding: list[EngineRow] = []
        self._kv_used = 0
        self._thread: threading.Thread | None = None
        self._threaded = False
        self._closed = False
        self.stats = StepStats()
        # a decode step from token ids, where the backend offers one (it embeds into its own bound input)
        self._step_tokens = getattr(self.slots, "step_tokens", None)
        # several greedy steps in one backend call, where the backend offers it (`_greedy_run`)
        self._decode_greedy = getattr(self.slots, "decode_greedy", None)
        # several rows' first prompts in one backend call, where the backend offers it (`_prefill_group`)
        self._prefill_rows = getattr(self.slots, "prefill_rows", None)

    def cap_rows(self, rows: int | None) -> None:
        """At most `rows` requests decode together from the next admission on (None: `max_batch` again); rows
        already decoding finish. edgekitd's policy sets it to the served point's batch size (`max_batch` knob)."""
        if rows is not None and rows < 1:
            raise EdgekitError(f"a row cap must be >= 1, got {rows}")
        self.row_cap = rows

    @property
    def rows_max(self) -> int:
        """The most rows that may decode together now: `max_batch`, or the cap set while running if lower."""
        return min(self.max_batch, self.row_cap or self.max_batch)

    # submitting --------------------------------------------------------------------------------------------
    def kv_need(self, request: Request) -> int:
        image = self.image_tokens if request.pixel_values is not None else 0
        return (request.prompt_ids.size + image + request.options.max_new_tokens) * self.kv_per_token

    def submit(self, request: Request) -> Ticket:
        """Queue `request`; thread-safe. Refuses one that could never fit the KV budget, or a full queue."""
        need = self.kv_need(request)
        if self.kv_budget is not None and need > self.kv_budget:
            raise KVBudgetError(
                f"this request's KV cache ({need / 2**20:.1f} MiB for {request.prompt_ids.size} prompt and "
                f"{request.options.max_new_tokens} new tokens) exceeds the engine's budget of "
                f"{self.kv_budget / 2**20:.1f} MiB"
            )
        ticket = Ticket(request)
        with self._lock:
            if self._closed:
                raise EngineBusyError("the engine is shut down")
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise EngineBusyError(f"{len(self._waiting)} requests already wait for the engine")
            self._waiting.append(ticket)
            if self._threaded:
                self._spawn()
            self._lock.notify_all()
        return ticket

    @property
    def in_flight(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # driving -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until nothing is waiting or in flight, in the caller's thread."""
        if self._threaded:
            raise EdgekitError("this engine runs on its own thread: wait on the tickets instead")
        while self.step():
            pass

    def start(self) -> Engine:
        """Drive the engine from its own thread from now on. The thread ends after `IDLE_EXIT_S` with nothing to
        do and the next `submit` starts another, so an engine nobody uses holds no thread (an unloaded variant is
        collected with its backend)."""
        with self._lock:
            self._threaded = True
            self._spawn()
        return self

    def _spawn(self) -> None:  # under the lock
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._loop, name="edgekit-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let those in flight finish, fail the ones still waiting."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            thread = self._thread
            self._lock.notify_all()
        for t in waiting:
            t._finish(None, EngineBusyError("the engine shut down before this request started"))
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._lock:
                idle_since = time.monotonic()
                while not self._waiting and not self.in_flight:
                    if self._closed or time.monotonic() - idle_since >= IDLE_EXIT_S:
                        self._thread = None
                        return
                    self._lock.wait(IDLE_EXIT_S)
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - a bug in a step must not leave callers waiting forever
                for r in [*self._prefilling, *self._decoding]:
                    self._fail(r, exc)

    def step(self) -> bool:
        """One round (admit, decode step, prefill chunk); False when there was nothing to do."""
        self._admit()
        if not self.in_flight:
            return False
        self._decode_step()
        self._prefill_chunk()
        return True

    # admission ---------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        if not self._waiting:  # read without the lock: a request queued meanwhile is admitted at the next step
            return
        admitted: list[EngineRow] = []
        limit = max(1, min(self.rows_max, self.controller.batch_size(self.stats)))
        with self._lock:
            while self._waiting and self._free_rows and self.in_flight + len(admitted) < limit:
                ticket = self._waiting[0]
                if ticket.cancelled:
                    self._waiting.popleft()
                    ticket._finish(_cancelled_result(), None)
                    continue
                need = self.kv_need(ticket.request)
                if self.kv_budget is not None and self._kv_used + need > self.kv_budget:
                    break  # waits for rows to leave
                self._waiting.popleft()
                self._kv_used += need
                opts = ticket.request.options
                admitted.append(
                    EngineRow(
                        ticket,
                        self._free_rows.pop(0),
                        need,
                        np.random.default_rng(opts.seed),
                        frozenset(int(t) for t in opts.stop_token_ids),
                        t_admitted=time.perf_counter(),
                    )
                )
        if admitted:
            self._lay_out(admitted)

    def _lay_out(self, rows: list[EngineRow]) -> None:
        """Encode the new rows' images (one call per image shape) and assemble their prefills."""
        by_shape: dict[tuple, list[tuple[EngineRow, np.ndarray]]] = {}
        for r in rows:
            pv = r.ticket.request.pixel_values
            if pv is not None:
                by_shape.setdefault(pv.shape, []).append((r, pv))
        images: dict[int, np.ndarray] = {}
        for group in by_shape.values():
            t0 = time.perf_counter()
            try:
                batch = np.stack([pv for _, pv in group])
                features = self.slots.encode_images(batch, [r.row for r, _ in group])
            except Exception as exc:  # noqa: BLE001 - the error goes to the requests, the engine keeps serving
                for r, _ in group:
                    self._fail(r, exc)
                continue
            dt = time.perf_counter() - t0
            self.stats.encodes += 1
            for i, (r, _) in enumerate(group):
                images[r.row], r.encode_s = features[i : i + 1], dt
        for r in rows:
            if r.reason is not None:
                continue
            try:
                req = r.ticket.request
                ids = req.prompt_ids[None]
                text = self.slots.embed(ids, [r.row])
                image = images.get(r.row)
                x, mask = place_image(text, np.ones_like(ids), image, req.image_slot)
                positions, nxt = self.scheme.prefill(mask, req.image_slot, 0 if image is None else image.shape[1])
            except Exception as exc:  # noqa: BLE001
                self._fail(r, exc)
                continue
            r.embeds, r.positions, r.next_pos = x, positions, int(nxt[0])
            r.t_encoded = time.perf_counter()
            self._prefilling.append(r)

    # the two kinds of backend call ---------------------------------------------------------------------------
    def _decode_step(self) -> None:
        rows = [r for r in self._decoding if not self._cancel_if_asked(r)]
        if not rows:
            return
        run = self._greedy_run_length(rows)
        if run > 1:
            return self._greedy_run(rows, run)
        t0 = time.perf_counter()
        try:
            if self._step_tokens is not None:  # the backend writes tokens and positions into its bound inputs
                logits = self._step_tokens([r.row for r in rows], [r.token for r in rows], [r.next_pos for r in rows])
            else:
                ids = np.asarray([[r.token] for r in rows], np.int64)
                x = self.slots.embed(ids, [r.row for r in rows])
                pos = self.scheme.step(np.fromiter([r.next_pos for r in rows], np.int64, len(rows)))
                logits = self.slots.step([r.row for r in rows], x, pos)
        except Exception as exc:  # noqa: BLE001
            for r in rows:
                self._fail(r, exc)
            return
        self.stats.record_step(len(rows), self._step_seconds(t0), self._step_bytes(rows))
        greedy = logits.argmax(-1).tolist()  # every greedy row's token from one call (sampled rows ignore it)
        for i, r in enumerate(rows):
            r.stepped(len(rows))
            self._choose(r, logits[i : i + 1], greedy[i])

    def _greedy_run_length(self, rows: list[EngineRow]) -> int:
        """How many decode steps the next backend call may take: 1, unless the backend runs several greedy steps
        in one call (`decode_greedy`) and nothing needs a step of its own in between: no prompt is prefilling
        (its chunks go between decode steps), every row is greedy, and none is due to stop at its cap sooner."""
        if self._decode_greedy is None or self.greedy_run_steps == 1 or self._prefilling:
            return 1
        left = self.greedy_run_steps
        for r in rows:
            opts = r.ticket.request.options
            if opts.temperature != 0:
                return 1
            left = min(left, opts.max_new_tokens - len(r.generated))
        return left

    def _greedy_run(self, rows: list[EngineRow], steps: int) -> None:
        """Up to `steps` greedy decode steps in one backend call, then each token kept as a single step keeps it.
        The run ends early when a row stops, a request arrives, or `GREEDY_RUN_S` has passed (which bounds how
        late a cancel, a streamed token or the controller's next decision can be)."""
        decode_greedy = self._decode_greedy
        assert decode_greedy is not None, "runs are taken only where the backend has them (_greedy_run_length)"
        waiting, queued = self._waiting, len(self._waiting)
        deadline = time.perf_counter() + GREEDY_RUN_S
        clock = time.perf_counter

        def more() -> bool:
            return len(waiting) == queued and clock() < deadline

        stops = frozenset().union(*(r.stops for r in rows))
        t0 = time.perf_counter()
        try:
            run = decode_greedy(
                [r.row for r in rows], [r.token for r in rows], [r.next_pos for r in rows], steps, stops, more
            )
        except Exception as exc:  # noqa: BLE001
            for r in rows:
                self._fail(r, exc)
            return
        seconds = self._step_seconds(t0) / len(run)
        for tokens in run:
            self.stats.record_step(len(rows), seconds, self._step_bytes(rows))
            for r, token in zip(rows, tokens):
                if r.reason is not None:  # it ended at an earlier step of the run (its stream's reader failed)
                    continue
                r.stepped(len(rows))
                self._choose(r, None, token)

    def _step_seconds(self, t0: float) -> float:
        """The step's time: the backend's own (an emulator's time on the device it emulates), else the wall time
        since `t0`. The controllers compare it with bandwidths and latency targets of that device."""
        own = getattr(self.slots, "last_step_seconds", None)
        return float(own) if own is not None else time.perf_counter() - t0

    def _step_bytes(self, rows: list[EngineRow]) -> float | None:
        """Bytes the step moved: the backend's own count (an emulator's), else its weights read once plus each
        row's KV cache read (the cpu target's estimate); None when the backend says neither."""
        exact = getattr(self.slots, "last_step_bytes", None)
        if exact is not None:
            return float(exact)
        weights = getattr(self.slots, "weight_bytes", None)
        if weights is None:
            return None
        return float(weights) + sum(r.length for r in rows) * self.kv_per_token

    def _prefill_chunk(self) -> None:
        while self._prefilling and self._cancel_if_asked(self._prefilling[0]):
            pass
        if not self._prefilling:
            return
        group = self._prefill_group()
        if len(group) > 1:
            return self._prefill_together(group)
        r = self._prefilling[0]
        embeds, positions = r.prompt()
        total = embeds.shape[1]
        end = total if self.prefill_chunk is None else min(total, r.cursor + self.prefill_chunk)
        t0 = time.perf_counter()
        try:
            logits = self.slots.prefill(r.row, embeds[:, r.cursor : end], positions[..., r.cursor : end])
        except Exception as exc:  # noqa: BLE001
            self._prefilling.popleft()
            self._fail(r, exc)
            return
        self.stats.record_prefill(end - r.cursor, time.perf_counter() - t0)
        r.cursor = r.length = end
        if end < total:
            return
        self._prefilling.popleft()
        self._prefilled(r, np.asarray(logits)[None])

    def _prefilled(self, r: EngineRow, logits: np.ndarray) -> None:
        """`r`'s whole prompt is in its cache: from now on it decodes, from its first token (`logits`: (1, vocab))."""
        r.embeds = r.positions = None
        r.t_first = time.perf_counter()
        self._decoding.append(r)
        self._choose(r, logits, int(logits.argmax()))

    def _prefill_group(self) -> list[EngineRow]:
        """The oldest prefilling request, and beside it those whose first prompt can share its prefill call
        (`prefill_rows`, where the backend has it; `rows.shared_prefill`), up to `prefill_chunk` tokens together,
        else `PREFILL_BATCH_TOKENS` while other rows decode."""
        if self._prefill_rows is None:
            return [self._prefilling[0]]
        budget = self.prefill_chunk or (PREFILL_BATCH_TOKENS if self._decoding else None)  # None: nothing waits
        return shared_prefill(list(self._prefilling), budget)

    def _prefill_together(self, group: list[EngineRow]) -> None:
        """The first prompts of `group` in one backend call (`_prefill_group` chose them)."""
        for r in group:
            self._prefilling.remove(r)
        prompts = [r.prompt() for r in group]
        embeds = np.concatenate([x for x, _ in prompts])  # (n, seq, hidden)
        positions = np.concatenate([pos for _, pos in prompts], axis=-2)  # (n, seq) or (3, n, seq)
        t0 = time.perf_counter()
        try:
            assert self._prefill_rows is not None, "groups form only where the backend has prefill_rows"
            logits = np.asarray(self._prefill_rows([r.row for r in group], embeds, positions))
        except Exception as exc:  # noqa: BLE001
            for r in group:
                self._fail(r, exc)
            return
        seq = embeds.shape[1]
        self.stats.record_prefill(seq * len(group), time.perf_counter() - t0)
        for i, r in enumerate(group):
            r.cursor = r.length = seq
            self._prefilled(r, logits[i : i + 1])

    # tokens and endings -----------------------------------------------------------------------------------
    def _choose(self, r: EngineRow, logits: np.ndarray | None, greedy: int) -> None:
        """`logits` (1, vocab); `greedy` its argmax, the token when the row does not sample (then `logits` may be
        None)."""
        opts = r.ticket.request.options
        if opts.temperature == 0:
            token = greedy
        else:
            assert logits is not None, "a sampling row needs its logits"
            token = int(next_tokens(logits, opts, r.rng)[0])
        if token in r.stops:
            return self._end(r, "stop_token")
        r.generated.append(token)
        r.token = token
        on_token = r.ticket.request.on_token
        if on_token is not None:
            try:
                on_token(token, len(r.generated) - 1)
            except Exception as exc:  # noqa: BLE001 - a reader that went away ends its own request only
                return self._fail(r, exc)
        if len(r.generated) >= opts.max_new_tokens:
            self._end(r, "max_new_tokens")

    def _cancel_if_asked(self, r: EngineRow) -> bool:
        if not r.ticket.cancelled:
            return False
        self._end(r, "cancelled")
        return True

    def _end(self, r: EngineRow, reason: str) -> None:
        r.reason = reason
        r.ticket._finish(GenerationResult(list(r.generated), reason, r.timings(time.perf_counter()), self._leave(r)))

    def _fail(self, r: EngineRow, exc: BaseException) -> None:
        r.reason = "error"
        try:
            self._leave(r)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        r.ticket._finish(None, exc)

    def _leave(self, r: EngineRow) -> dict:
        if r in self._decoding:
            self._decoding.remove(r)
        if r in self._prefilling:
            self._prefilling.remove(r)
        try:
            return self.slots.release(r.row)
        finally:
            with self._lock:
                self._free_rows.append(r.row)
                self._free_rows.sort()
                self._kv_used -= r.kv_reserved


def _cancelled_result() -> GenerationResult:
    return GenerationResult([], "cancelled", Timings(0.0, 0.0, 0.0, 0.0))


def generate_all(engine: Engine, requests: Sequence[Request]) -> list[Ticket]:
    """Submit `requests` and drive `engine` until they are done (in the caller's thread)."""
    tickets = [engine.submit(r) for r in requests]
    engine.run()
    return tickets
