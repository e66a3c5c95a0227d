"""The token engine (`edgekit.engine`): continuous batching gives every request the tokens it gets alone.

On the tiny random model through the portable cpu backend (rows of different lengths left-padded into one batch),
which is what every target without its own rows gets. The fast cpu run side and x1 have their own batched tests.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edgekit.engine import Engine, EngineBusyError, FixedBatch, KVBudgetError, LatencyTarget, Request
from edgekit.engine.control import BandwidthRule, StepStats
from edgekit.engine.scheduler import IDLE_EXIT_S
from edgekit.errors import EdgekitError
from edgekit.generate import GenerationOptions, generate

from small_model import SMALL


def _prompt(rng, n):
    return rng.integers(5, SMALL.vocab_size, n)


def _pixels(rng):
    return rng.uniform(-1, 1, (2, 1, 32, 32)).astype(np.float32)


def _alone(backend, req: Request) -> list[int]:
    pv = None if req.pixel_values is None else req.pixel_values[None]
    return generate(backend, pv, req.prompt_ids[None], req.options, image_slot=req.image_slot).token_ids


def _requests(n=5, new=(9, 4, 12, 7, 10)):
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        pv = _pixels(rng) if i % 2 == 0 else None  # images and text-only requests side by side
        out.append(
            Request(
                _prompt(rng, 3 + 2 * i),
                GenerationOptions(max_new_tokens=new[i % len(new)], temperature=0.8 if i == 3 else 0.0, seed=i),
                pv,
                image_slot=1 if pv is not None else 0,
            )
        )
    return out


def test_batched_requests_get_the_tokens_they_get_alone(small_backend):
    reqs = _requests()
    alone = [_alone(small_backend, r) for r in reqs]
    engine = Engine(small_backend, max_batch=4)
    tickets = [engine.submit(r) for r in reqs]
    engine.run()
    assert [t.result().token_ids for t in tickets] == alone
    assert engine.stats.steps < sum(len(a) for a in alone)  # rows really shared steps
    assert max(rows for rows, _, _ in engine.stats.recent) > 1


def test_a_row_cap_set_while_running_bounds_the_rows_until_lifted(small_backend):
    """edgekitd's policy caps the served variant's rows at its point's batch size: the cap holds from the next
    admission, each row says the batch it shared (`decode_batch_mean`), and the tokens stay those alone."""
    reqs = _requests()
    alone = [_alone(small_backend, r) for r in reqs]
    engine = Engine(small_backend, max_batch=4)
    engine.cap_rows(1)
    tickets = [engine.submit(r) for r in reqs]
    engine.run()
    assert [t.result().token_ids for t in tickets] == alone
    assert max(rows for rows, _, _ in engine.stats.recent) == 1
    assert {t.result().timings.decode_batch_mean for t in tickets} == {1.0}
    engine.cap_rows(None)
    tickets = [engine.submit(r) for r in reqs]
    engine.run()
    assert [t.result().token_ids for t in tickets] == alone
    shared = [t.result().timings.decode_batch_mean for t in tickets]
    assert max(shared) > 1 and all(1 <= m <= 4 for m in shared)
    with pytest.raises(EdgekitError, match="row cap must be >= 1"):
        engine.cap_rows(0)


def test_requests_join_while_others_decode(small_backend):
    reqs = _requests()
    alone = [_alone(small_backend, r) for r in reqs]
    engine = Engine(small_backend, max_batch=3)
    first = [engine.submit(r) for r in reqs[:2]]
    for _ in range(3):  # the first two are decoding when the others arrive
        engine.step()
    later = [engine.submit(r) for r in reqs[2:]]
    engine.run()
    assert [t.result().token_ids for t in first + later] == alone


def test_chunked_prefill_gives_the_same_tokens(small_backend):
    reqs = _requests()
    alone = [_alone(small_backend, r) for r in reqs]
    engine = Engine(small_backend, max_batch=4, prefill_chunk=3)
    tickets = [engine.submit(r) for r in reqs]
    engine.run()
    assert [t.result().token_ids for t in tickets] == alone


def test_stop_tokens_and_caps_are_per_row(small_backend):
    rng = np.random.default_rng(3)
    prompt = _prompt(rng, 5)
    free = _alone(small_backend, Request(prompt, GenerationOptions(max_new_tokens=10)))
    engine = Engine(small_backend, max_batch=2)
    stopped = engine.submit(Request(prompt, GenerationOptions(max_new_tokens=10, stop_token_ids=[free[4]])))
    capped = engine.submit(Request(prompt, GenerationOptions(max_new_tokens=3)))
    engine.run()
    assert stopped.result().token_ids == free[: free.index(free[4])]
    assert stopped.result().stop_reason == "stop_token"
    assert capped.result().token_ids == free[:3] and capped.result().stop_reason == "max_new_tokens"


def test_on_token_streams_each_row_and_a_failing_reader_ends_only_its_row(small_backend):
    reqs = _requests(3)
    alone = [_alone(small_backend, r) for r in reqs]
    seen: list[tuple[int, int]] = []

    def broken(token, index):
        if index == 2:
            raise ConnectionResetError("reader went away")

    reqs[0].on_token = lambda t, i: seen.append((t, i))
    reqs[1].on_token = broken
    engine = Engine(small_backend, max_batch=3)
    tickets = [engine.submit(r) for r in reqs]
    engine.run()
    assert [t for t, _ in seen] == alone[0] and [i for _, i in seen] == list(range(len(alone[0])))
    with pytest.raises(ConnectionResetError):
        tickets[1].result()
    assert tickets[2].result().token_ids == alone[2]


def test_cancel_ends_a_row_and_keeps_its_tokens(small_backend):
    reqs = _requests(2, new=(30, 30))
    engine = Engine(small_backend, max_batch=2)
    a, b = (engine.submit(r) for r in reqs)
    for _ in range(4):
        engine.step()
    a.cancel()
    engine.run()
    assert a.result().stop_reason == "cancelled" and 0 < len(a.result().token_ids) < 30
    assert b.result().token_ids == _alone(small_backend, reqs[1])


def test_kv_budget_makes_requests_wait_and_refuses_what_never_fits(small_backend):
    reqs = _requests(4, new=(8,))
    engine = Engine(small_backend, max_batch=4)
    one = engine.kv_need(reqs[0])
    budget = Engine(small_backend, max_batch=4, kv_budget_bytes=max(engine.kv_need(r) for r in reqs) + one // 2)
    tickets = [budget.submit(r) for r in reqs]
    budget.run()
    assert [t.result().token_ids for t in tickets] == [_alone(small_backend, r) for r in reqs]
    assert max(rows for rows, _, _ in budget.stats.recent) == 1  # never two at once: they waited
    tiny = Engine(small_backend, kv_budget_bytes=one - 1)
    with pytest.raises(KVBudgetError) as err:
        tiny.submit(reqs[0])
    assert err.value.http_status == 503 and "budget" in str(err.value)


def test_a_full_queue_answers_busy(small_backend):
    engine = Engine(small_backend, max_waiting=2)
    reqs = _requests(3)
    engine.submit(reqs[0])
    engine.submit(reqs[1])
    with pytest.raises(EngineBusyError) as err:
        engine.submit(reqs[2])
    assert err.value.code == "engine_busy" and err.value.http_status == 503


def test_a_backend_error_fails_its_rows_and_the_engine_serves_on(small_backend):
    reqs = _requests(2)
    bad = Request(np.asarray([SMALL.vocab_size + 5]), GenerationOptions(max_new_tokens=3))  # out of the vocab
    engine = Engine(small_backend, max_batch=2)
    t_bad = engine.submit(bad)
    engine.run()
    with pytest.raises(Exception, match="(?i)index|indices|out of"):  # ONNX Runtime's Gather refuses the id
        t_bad.result()
    good = [engine.submit(r) for r in reqs]
    engine.run()
    assert [t.result().token_ids for t in good] == [_alone(small_backend, r) for r in reqs]


def test_threads_submit_into_one_running_engine_and_its_thread_ends_when_idle(small_backend, monkeypatch):
    import edgekit.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "IDLE_EXIT_S", 0.2)
    reqs = _requests()
    engine = Engine(small_backend, max_batch=4).start()
    results: dict[int, list[int]] = {}

    def client(i):
        results[i] = engine.submit(reqs[i]).result(timeout=60).token_ids

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(reqs))] == [_alone(small_backend, r) for r in reqs]
    deadline = time.monotonic() + 5
    while engine._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine._thread is None  # idle: no thread held
    assert engine.submit(reqs[0]).result(timeout=60).token_ids == results[0]  # and a new one starts on demand
    with pytest.raises(Exception, match="own thread"):
        engine.run()
    engine.close()
    assert IDLE_EXIT_S > 1  # the default keeps a busy server's thread


def test_controllers_follow_their_rules():
    fixed = FixedBatch(8)
    stats = StepStats()
    assert fixed.batch_size(stats) == 8
    rule = BandwidthRule(max_size=8, limit_bytes_per_s=100.0, every=1)
    for _ in range(2):
        stats.record_step(8, 1.0, 95.0)  # 95% of the limit: cut to 0.6x
    assert rule.batch_size(stats) == 4
    for _ in range(32):
        stats.record_step(4, 1.0, 30.0)  # 30%: raise 1.5x
    assert rule.batch_size(stats) == 6
    assert rule.batch_size(StepStats()) == 6  # no new steps: no decision
    latency = LatencyTarget(max_size=8, target_s=0.010, every=1)
    slow = StepStats()
    for _ in range(10):
        slow.record_step(8, 0.020)
    assert latency.batch_size(slow) == 7
