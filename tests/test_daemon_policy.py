"""The policy's decisions on a hand-made front (data, not a mock): modes, constraints, signals, anti-flapping."""

from __future__ import annotations

import json

import pytest

from edgekit.daemon.policy import Constraints, Governor, PolicySettings, Signals, choose, gain
from edgekit.errors import ConfigError
from edgekit.pareto import Point, Profile, non_dominated, read_profile, write_profile


def point(pid, f1, energy_j, p50_ms, p95_ms=None, load_ms=0.0):
    return Point(
        id=pid,
        bundle=f"/bundles/{pid}",
        bundle_digest=pid * 4,
        target="cpu",
        settings={"variant": pid},
        f1=f1,
        f1_ci=(f1 - 0.01, min(1.0, f1 + 0.01)),
        hallucination_rate=0.0,
        latency_p50_ms=p50_ms,
        latency_p95_ms=p95_ms or p50_ms * 1.1,
        energy_j=energy_j,
        energy_source="estimated:test",
        peak_rss_mib=100.0,
        count=300,
        load_ms=load_ms,
    )


FP32 = point("fp32", 0.995, 10.0, 1000)  # 10 W
INT8 = point("int8", 0.990, 6.0, 700)  # 8.6 W
INT4 = point("int4", 0.985, 3.0, 500)  # 6 W
TINY = point("tiny", 0.900, 1.0, 300)  # 3.3 W
FRONT = [FP32, INT8, INT4, TINY]


def test_modes_pick_best_cheapest_and_near_best():
    assert choose(FRONT, PolicySettings(mode="performance"), Signals(), None).point is FP32
    assert choose(FRONT, PolicySettings(mode="saver"), Signals(), None).point is TINY
    # balanced: the cheapest within one F1 point of the best
    assert choose(FRONT, PolicySettings(mode="balanced"), Signals(), None).point is INT4
    floor = PolicySettings(mode="saver", constraints=Constraints(quality_floor_f1=0.95))
    assert choose(FRONT, floor, Signals(), None).point is INT4


def test_power_budget_and_latency_slo_filter_points():
    c = Constraints(power_budget_w=9.0)
    assert choose(FRONT, PolicySettings(mode="performance", constraints=c), Signals(), None).point is INT8
    c = Constraints(latency_slo_ms=600)
    assert choose(FRONT, PolicySettings(mode="performance", constraints=c), Signals(), None).point is INT4


def test_no_point_fits_serves_best_quality_within_power_and_names_the_broken_constraint():
    c = Constraints(power_budget_w=9.0, quality_floor_f1=0.999)
    choice = choose(FRONT, PolicySettings(mode="saver", constraints=c), Signals(), None)
    assert choice.point is INT8 and choice.broken == ("quality_floor_f1",)
    impossible = Constraints(power_budget_w=1.0)
    choice = choose(FRONT, PolicySettings(constraints=impossible), Signals(), None)
    assert choice.point is TINY and "power_budget_w" in choice.broken


def test_signals_turn_the_policy_to_saving():
    perf = PolicySettings(mode="performance", constraints=Constraints(quality_floor_f1=0.95))
    assert choose(FRONT, perf, Signals(battery_pct=20, on_battery=True), FP32).point is INT4
    assert choose(FRONT, perf, Signals(battery_pct=20, on_battery=False), FP32).point is FP32  # on AC
    hot = choose(FRONT, perf, Signals(thermal_headroom_c=2.0), FP32)
    assert hot.point is INT4 and hot.reason == "thermal"
    # past the trip point: cooler than now even if the quality floor breaks
    past = choose(FRONT, perf, Signals(thermal_headroom_c=-1.0), INT4)
    assert past.point is TINY and past.broken == ("quality_floor_f1",)
    over = choose(
        FRONT,
        PolicySettings(mode="performance", constraints=Constraints(power_budget_w=12)),
        Signals(power_w=15.0),
        FP32,
    )
    assert over.reason == "power" and over.point.power_w < FP32.power_w
    busy = choose(FRONT, perf, Signals(queue_depth=8), FP32)
    assert busy.reason == "load" and busy.point is INT4  # fastest within the floor


def test_step_down_is_immediate_step_up_waits_for_the_window_and_margin():
    gov = Governor(FRONT, PolicySettings(mode="performance", window_s=300, margin=0.10))
    assert gov.tick(0, Signals()).point is FP32
    d = gov.tick(1, Signals(on_battery=True, battery_pct=10))
    assert d.switched and d.point is TINY and d.reason == "battery"
    # charger back: the better point waits for 300 s of calm
    assert gov.tick(2, Signals()).held_back == "window"
    assert gov.tick(250, Signals()).point is TINY
    d = gov.tick(303, Signals())
    assert d.switched and d.point is FP32 and d.reason.endswith("step_up")
    assert gov.switches == 2


def test_a_step_up_below_the_margin_is_not_taken():
    a, b = point("a", 0.980, 2.0, 500), point("b", 0.981, 2.0, 500)
    gov = Governor([a, b], PolicySettings(mode="performance", window_s=10, margin=0.10))
    gov.current, gov.since = a, 0.0  # serving a; b is 5% fewer errors, under the 10% margin
    assert gain(a, b, "performance") == pytest.approx(0.05, rel=1e-3)
    assert gov.tick(100, Signals()).held_back == "window"
    assert gov.tick(200, Signals()).held_back == "margin"


def test_load_oscillating_faster_than_the_window_switches_at_most_once_per_window():
    gov = Governor(FRONT, PolicySettings(mode="performance", window_s=300))
    gov.tick(0, Signals())
    for t in range(1, 3601):  # a burst every 60 s for an hour
        gov.tick(t, Signals(queue_depth=10 if (t // 30) % 2 else 0))
    # the first burst steps down at once; calm never lasts the window, so it never steps back up
    assert gov.switches == 1 and gov.current is TINY  # no quality floor: the fastest


def test_no_switch_before_the_current_variant_has_been_up_its_load_time():
    slow = point("slow", 0.995, 10.0, 1000, load_ms=5000)
    gov = Governor([slow, TINY], PolicySettings(mode="performance"))
    gov.tick(0, Signals())
    assert gov.tick(1, Signals(thermal_headroom_c=-5)).held_back == "load_time"
    assert gov.tick(6, Signals(thermal_headroom_c=-5)).point is TINY


def test_fixed_mode_and_bad_settings():
    assert choose(FRONT, PolicySettings(mode="fixed", fixed="int8"), Signals(thermal_headroom_c=-9), FP32).point is INT8
    with pytest.raises(ConfigError, match="mode must be one of"):
        PolicySettings(mode="turbo").check()
    with pytest.raises(ConfigError, match="needs policy.fixed"):
        PolicySettings(mode="fixed").check()
    with pytest.raises(ConfigError, match="power_budget_w must be a finite number"):
        PolicySettings(constraints=Constraints(power_budget_w=-1)).check()
    with pytest.raises(ConfigError, match="no profiled point or variant named 'nope'"):
        choose(FRONT, PolicySettings(mode="fixed", fixed="nope"), Signals(), None)


def test_front_and_profile_round_trip(tmp_path):
    slower_and_worse = point("bad", 0.98, 12.0, 1200)
    assert [p.id for p in non_dominated([*FRONT, slower_and_worse])] == ["tiny", "int4", "int8", "fp32"]
    path = write_profile(Profile([*FRONT, slower_and_worse], split={"name": "test", "count": 300}), tmp_path / "p.json")
    back = read_profile(path)
    assert back.by_id()["int4"] == INT4 and json.loads(path.read_text())["front"] == ["tiny", "int4", "int8", "fp32"]
    path.write_text('{"schema": "other"}')
    with pytest.raises(ConfigError, match="not a Pareto profile"):
        read_profile(path)


def test_new_settings_take_effect_at_the_next_tick_without_the_window():
    gov = Governor(FRONT, PolicySettings(mode="performance", window_s=300))
    gov.tick(0, Signals())
    gov.configure(PolicySettings(mode="saver", window_s=300))
    d = gov.tick(1, Signals())
    assert d.switched and d.point is TINY and d.reason == "settings"


def test_past_a_trip_point_the_reason_stays_thermal_whatever_the_board_draws():
    hot = choose(FRONT, PolicySettings(mode="performance"), Signals(thermal_headroom_c=-1.0, power_w=50.0), INT8)
    assert hot.reason == "thermal" and hot.point.power_w < INT8.power_w


def test_batch_size_is_chosen_by_power_budget_energy_and_load():
    """The x1 INT4 sweep of docs/engine.md (bench/pareto_front.py --batches 4 8): `saver` takes the batch with the
    least energy per report, a power budget below the full batch's draw keeps a smaller one, and under load `fast`
    takes the batch that drains a queue fastest (p95 per report in flight), not the lowest p95 of one report."""
    from dataclasses import replace

    def batched(n, mj, p50, p95):
        base = point(f"x1-int4[max_batch={n}]", 0.981, mj / 1e3, p50, p95)
        return replace(base, settings={"variant": "x1-int4", "max_batch": n}, count=120)

    one, four, eight = batched(1, 2.398, 0.539, 1.081), batched(4, 1.057, 0.555, 1.098), batched(8, 0.651, 0.567, 1.131)
    assert [p.power_w for p in (one, four, eight)] == pytest.approx([4.45, 7.62, 9.18], abs=0.01)
    points = [one, four, eight]
    assert choose(points, PolicySettings(mode="saver"), Signals(), None).point is eight
    budget = PolicySettings(mode="saver", constraints=Constraints(power_budget_w=9.0))
    assert choose(points, budget, Signals(), None).point is four
    assert choose(points, PolicySettings(mode="performance"), Signals(queue_depth=8), None).point is eight
