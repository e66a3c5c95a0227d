"""The sampler: integration against meters with a known power, windows, fallback when a meter dies or lies.

The meters below are test inputs (a power profile we know the integral of), not stand-ins for a component:
the sampler is the part under test. Most tests use a virtual clock (each reading advances it), so the expected
joules are exact; the threaded ones use the wall clock and allow for its jitter.
"""

import logging
import math
import threading
import time

import pytest

from edgekit.energy import (
    CpuTimeMeter,
    Ina3221Meter,
    MeterReadError,
    PowerReading,
    Sampler,
    estimated,
    measured,
)
from edgekit.errors import ConfigError

from energy_trees import copy_tree

RAIL = measured("test:rail")
COUNTER = estimated("test-counter")


class VClock:
    def __init__(self, dt: float = 0.05):
        self.t, self.dt = 100.0, dt

    def tick(self) -> float:
        self.t += self.dt
        return self.t


class ProfileMeter:
    """Power `fn(t)` W at each reading; fails (`die_after` readings) or lies (`lie_after`: returns `lie`)."""

    def __init__(self, fn, clock=None, source=RAIL, die_after=None, lie_after=None, lie=math.nan):
        self.fn, self.clock, self.source = fn, clock, source
        self.die_after, self.lie_after, self.lie = die_after, lie_after, lie
        self.reads: list[tuple[float, float]] = []

    def read(self) -> PowerReading:
        if self.die_after is not None and len(self.reads) >= self.die_after:
            raise MeterReadError(f"{self.source}: the file went away")
        t = self.clock.tick() if self.clock else time.monotonic()
        w = self.lie if self.lie_after is not None and len(self.reads) >= self.lie_after else self.fn(t)
        self.reads.append((t, w))
        return PowerReading(w, self.source, t)

    def describe(self) -> dict:
        return {"source": self.source}


class CounterMeter:
    """A joule counter that grows at `watts` W on the virtual clock; `backwards_after` readings, it resets."""

    def __init__(self, watts, clock, source=COUNTER, backwards_after=None):
        self.watts, self.clock, self.source, self.backwards_after = watts, clock, source, backwards_after
        self.n, self.t0 = 0, clock.t

    def read(self) -> PowerReading:
        t = self.clock.tick()
        self.n += 1
        j = self.watts * (t - self.t0)
        if self.backwards_after is not None and self.n > self.backwards_after:
            j = 0.0
        return PowerReading(self.watts, self.source, t, energy_j=j)

    def describe(self) -> dict:
        return {"source": self.source}


def test_trapezoid_is_exact_for_a_linear_ramp():
    clock = VClock(0.05)
    m = ProfileMeter(lambda t: 2.0 + 3.0 * (t - 100.0), clock)
    s = Sampler([m])
    with s.window() as w:
        for _ in range(20):
            s.sample()
    t0, t1 = w.t_start - 100.0, w.t_end - 100.0
    exact = 2.0 * (t1 - t0) + 1.5 * (t1**2 - t0**2)
    assert w.joules == pytest.approx(exact, rel=1e-12)
    assert w.seconds == pytest.approx(21 * 0.05) and w.reading.samples == 22
    assert w.source == "measured:test:rail" and w.reading.fell_back_from == ()


def counter_window(watts: float, step_s: float):
    """A window over two samples of a counter meter whose clock advances `step_s` a reading."""
    s = Sampler([CounterMeter(watts, VClock(step_s))])
    with s.window() as w:
        s.sample()
        s.sample()
    return w


def test_a_counter_meter_is_integrated_by_difference():
    w = counter_window(7.5, 0.2)
    assert w.joules == pytest.approx(7.5 * 0.6)
    assert w.reading.mean_watts == pytest.approx(7.5)


def test_overlapping_windows_add_up():
    clock = VClock()
    s = Sampler([ProfileMeter(lambda t: 4.0, clock)])
    with s.window() as outer:
        s.sample()
        with s.window() as inner:
            s.sample()
        s.sample()
    assert inner.joules == pytest.approx(4.0 * inner.seconds)
    assert outer.joules == pytest.approx(4.0 * outer.seconds) and outer.joules > inner.joules


def test_a_report_that_shared_its_decode_steps_is_billed_its_share_of_the_window():
    """A host meter sees the whole machine: a report decoded beside two others (three rows a step on average) is
    billed a third of its time in the engine, and none of its wait for a row. A target that bills its own device (x1's
    emulator) already bills each row its part, so its figure is not divided again."""
    from edgekit.engine.sequence import Timings
    from edgekit.reporter import report_energy

    w = counter_window(6.0, 0.1)
    assert w.joules == pytest.approx(6.0 * 0.3)
    assert report_energy({}, w) == (pytest.approx(w.joules), COUNTER)
    shared = Timings(encode_ms=0, prefill_ms=0, decode_ms=300, decode_tokens_per_s=100, decode_batch_mean=3.0)
    assert report_energy({}, w, shared.meter_share) == (pytest.approx(w.joules / 3), COUNTER)
    queued = Timings(encode_ms=10, prefill_ms=10, decode_ms=180, decode_tokens_per_s=100, wait_ms=100)
    assert queued.meter_share == pytest.approx(200 / 300)
    mixed = Timings(
        encode_ms=10, prefill_ms=10, decode_ms=180, decode_tokens_per_s=100, wait_ms=100, decode_batch_mean=2
    )
    assert mixed.meter_share == pytest.approx(200 / 2 / 300)
    own = {"energy_j": 0.5, "figure_source": "emulated:x1", "latency_ms": 2.0}
    assert report_energy(own, w, shared.meter_share) == (0.5, "emulated:x1")


def test_a_dying_meter_falls_back_to_the_next_labelled_as_such_and_logged_once(caplog):
    clock = VClock(0.05)
    a = ProfileMeter(lambda t: 10.0, clock, die_after=6)
    b = CounterMeter(2.0, clock)
    s = Sampler([a, b])
    with caplog.at_level(logging.WARNING, logger="edgekit.energy"):
        with s.window() as w:
            for _ in range(12):
                s.sample()
        with s.window() as after:
            s.sample()
    ((t_a, _),) = a.reads[-1:]  # the last good reading of a
    # a's 10 W up to its last reading, bridged at 10 W to b's first reading, then b's 2 W to the end
    b_first = t_a + 0.05
    exact = 10.0 * (t_a - w.t_start) + 10.0 * (b_first - t_a) + 2.0 * (w.t_end - b_first)
    assert w.joules == pytest.approx(exact, rel=1e-9)
    assert w.source == "estimated:test-counter"  # the weaker of the two labels
    assert w.reading.fell_back_from == ("measured:test:rail",)
    assert after.source == "estimated:test-counter" and after.reading.fell_back_from == ()
    assert after.joules == pytest.approx(2.0 * after.seconds)
    warnings = [r for r in caplog.records if r.name == "edgekit.energy"]
    assert len(warnings) == 1
    assert "measured:test:rail failed" in warnings[0].getMessage()
    assert "falling back to estimated:test-counter" in warnings[0].getMessage()
    assert s.failed == [("measured:test:rail", "measured:test:rail: the file went away")]


@pytest.mark.parametrize("lie", [math.nan, math.inf, -3.0, 1e9, "12 W"])
def test_garbage_readings_are_refused_and_the_next_meter_takes_over(lie):
    clock = VClock()
    s = Sampler([ProfileMeter(lambda t: 5.0, clock, lie_after=3, lie=lie), ProfileMeter(lambda t: 1.0, clock)])
    for _ in range(6):
        s.sample()
    assert s.source == "measured:test:rail" and len(s.failed) == 1
    assert "not a number" in s.failed[0][1]
    assert s.latest().watts == 1.0


def test_a_counter_that_runs_backwards_is_refused():
    clock = VClock()
    rapl = CounterMeter(3.0, clock, source=measured("rapl:package-0"), backwards_after=3)
    s = Sampler([rapl, CounterMeter(1.0, clock)])
    for _ in range(5):
        s.sample()
    assert s.failed[0][0] == "measured:rapl:package-0" and "ran backwards" in s.failed[0][1]
    assert s.source == "estimated:test-counter"


def test_when_every_meter_has_died_windows_carry_no_figure(caplog):
    clock = VClock()
    s = Sampler([ProfileMeter(lambda t: 5.0, clock, die_after=2)])
    with caplog.at_level(logging.WARNING, logger="edgekit.energy"):
        with s.window() as w:
            for _ in range(5):
                s.sample()
        with s.window() as later:
            pass
    assert w.reading is None and w.joules is None and w.source is None
    assert later.reading is None and s.source is None
    assert len([r for r in caplog.records if "no meter left" in r.getMessage()]) == 1


def test_the_thread_samples_at_its_interval_and_integrates_a_known_profile():
    m = ProfileMeter(lambda t: 6.0 + 2.0 * math.sin(2 * math.pi * t / 0.4))
    with Sampler([m], interval_s=0.01) as s, s.window() as w:
        time.sleep(0.8)
    t0, t1 = w.t_start, w.t_end
    w_ = 2 * math.pi / 0.4
    exact = 6.0 * (t1 - t0) - 2.0 / w_ * (math.cos(w_ * t1) - math.cos(w_ * t0))
    assert w.joules == pytest.approx(exact, rel=0.02)
    assert len(m.reads) >= 20  # 80 at 10 ms on an idle machine; CI's 2 shared cores may lag
    assert s.thread_cpu_s > 0


def test_windows_from_many_threads_while_sampling_stay_consistent():
    m = ProfileMeter(lambda t: 3.0)
    results = []

    def report():
        with s.window() as w:
            time.sleep(0.05)
        results.append(w)

    with Sampler([m], interval_s=0.005) as s:
        threads = [threading.Thread(target=report) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 8
    for w in results:
        assert w.joules == pytest.approx(3.0 * w.seconds, rel=1e-9)
        assert w.seconds >= 0.05


def test_an_ina3221_rail_that_vanishes_mid_run_falls_back_to_the_cpu_estimate(tmp_path):
    root = copy_tree("orin_nano", tmp_path)
    s = Sampler([Ina3221Meter(root), CpuTimeMeter()])
    with s.window() as w:
        s.sample()
        (root / "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1/curr1_input").unlink()
        sum(i * i for i in range(200_000))  # some CPU time for the estimate to bill
        s.sample()
    assert w.source == "estimated:cpu-time-ccf-aws"
    assert w.reading.fell_back_from == ("measured:ina3221:VDD_IN",)
    assert w.joules > 0
    assert s.source == "estimated:cpu-time-ccf-aws"


def test_the_interval_is_checked():
    with pytest.raises(ConfigError, match="between 1 ms and 60 s"):
        Sampler([ProfileMeter(lambda t: 1.0)], interval_s=0.0)
    with pytest.raises(ValueError):
        Sampler([])
