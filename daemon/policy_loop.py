"""The policy at run time: the profile matched to the configured variants, a tick that reads the signals and lets
the `Governor` decide, and switches that load the next variant beside the current one before new work moves.

Zero-drop by construction: `VariantRegistry.activate` loads and warms the new variant before the active name
moves, and a report holds the variant it started on until it ends. Every decision that switches, or that cannot
meet a constraint, is logged once with its reason (never patient data) and counted in the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from edgekit.errors import ConfigError, EdgekitError
from edgekit.pareto import Point, read_profile, split_fronts

from . import telemetry
from .config import DaemonConfig
from .metrics import Metrics
from .options import RequestOptions
from .policy import MODES, Constraints, Decision, Governor, PolicySettings, Signals, best_quality, find
from .variants import VariantRegistry

log = logging.getLogger("edgekitd")


class OverrideNotAllowedError(EdgekitError):
    code = "override_not_allowed"
    http_status = 403


class PolicyNotConfiguredError(EdgekitError):
    code = "policy_not_configured"
    http_status = 404


# The knobs a point may set that edgekitd applies per report, and the one it applies to the served variant's engine
# (its batch size caps the rows decoding together). The others (the X1's DSS target, threads) are fixed when a
# variant loads: a point with them belongs to the variant configured with the same `settings` (one bundle may be
# listed twice, dense and sparse), and is left out of the choice otherwise, which the log says.
PER_REPORT_KNOBS = ("max_new_tokens", "video_max_frames")
ENGINE_KNOB = "max_batch"
APPLIED_KNOBS = {"variant", *PER_REPORT_KNOBS, ENGINE_KNOB}


def load_time_knobs(point: Point) -> dict:
    return {k: v for k, v in point.settings.items() if k not in APPLIED_KNOBS}


def match_profile(cfg: DaemonConfig, registry: VariantRegistry) -> list[Point]:
    """The profile's points of the configured variants, each named by its variant. A configured variant with no
    point (its bundle was rebuilt, or never profiled: another sha256) refuses the start, naming the profile."""
    from edgekit.bundle import load_bundle

    assert cfg.policy_profile is not None
    profile = read_profile(cfg.policy_profile)
    points: list[Point] = []
    for name, spec in registry.specs.items():
        digest = load_bundle(spec.bundle).digest
        ours = [p for p in profile.points if p.bundle_digest == digest]
        mine = [p for p in ours if load_time_knobs(p) == dict(spec.settings)]
        if len(mine) < len(ours):
            log.info(
                "policy: %d point(s) of variant %s were measured with other load-time settings than its %s; "
                "not chosen for it",
                len(ours) - len(mine),
                name,
                dict(spec.settings) or "none",
            )
        if not mine:
            settings = f" with settings {dict(spec.settings)}" if spec.settings else ""
            raise ConfigError(
                f"no point for variant {name!r}{settings} (bundle {spec.bundle}, sha256 {digest[:12]}...): the "
                "profile was measured on other bundles or settings; run `edgekit pareto` on the configured ones",
                cfg.policy_profile,
            )
        points += [replace(p, settings={**p.settings, "variant": name}) for p in mine]
    one_front(points, cfg.policy_profile)
    alone = sum(1 for p in points if ENGINE_KNOB not in p.settings)
    if alone and cfg.max_batch > 1:
        log.info(
            "policy: %d of %d points were measured one report at a time (no max_batch); under load edgekitd decodes "
            "up to %d rows together, which draws more power than their figures say (`edgekit pareto --max-batch` "
            "measures it)",
            alone,
            len(points),
            cfg.max_batch,
        )
    return points


def one_front(points: list[Point], where) -> None:
    """The policy ranks its points by energy and latency, so they must share a front: one energy source and one
    latency source (the device the daemon runs on). A profile may hold several fronts (`edgekit pareto` on cpu and
    x1 bundles); the configured variants pick one by their digests. Variants on two fronts refuse the start."""
    fronts = split_fronts(points)
    if len(fronts) > 1:
        seen = "; ".join(f"{', '.join(sorted({p.settings['variant'] for p in f.points}))}: {f.label}" for f in fronts)
        raise ConfigError(
            f"the configured variants' points lie on {len(fronts)} fronts ({seen}): figures from different "
            "sources are never compared; configure the variants of one device, or profile them with one meter",
            where,
        )


def settings_from_json(body: dict[str, Any], current: PolicySettings) -> PolicySettings:
    """`PUT /v1/policy`: any of mode, fixed, the constraints (null clears one) and the tuning numbers, over the
    settings in force. Unknown keys and bad values are a 400 (`ConfigError`)."""
    if not isinstance(body, dict):
        raise ConfigError("the policy must be a JSON object")
    constraint_keys = set(vars(Constraints()))
    known = {"mode", "fixed", *constraint_keys, "window_s", "margin", "balanced_f1_slack", "battery_low_pct"}
    known |= {"thermal_margin_c", "queue_high", "allow_overrides"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ConfigError(f"unknown policy key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for key, value in body.items():
        if key in ("mode", "fixed"):
            ok = isinstance(value, str) or (key == "fixed" and value is None)
        elif key == "allow_overrides":
            ok = isinstance(value, bool)
        else:
            ok = (value is None and key in constraint_keys) or (
                isinstance(value, (int, float)) and not isinstance(value, bool)
            )
        if not ok:
            raise ConfigError(f"policy {key} has the wrong type ({type(value).__name__})")
    constraints = replace(current.constraints, **{k: body[k] for k in constraint_keys if k in body})
    rest = {k: v for k, v in body.items() if k not in constraint_keys}
    new = replace(current, **rest, constraints=constraints)
    new.check()
    return new


class PolicyLoop:
    def __init__(
        self,
        cfg: DaemonConfig,
        registry: VariantRegistry,
        metrics: Metrics,
        read_signals: Callable[[], Signals],
        clock: Callable[[], float] = time.monotonic,
    ):
        assert cfg.policy is not None
        self.registry, self.metrics, self.read_signals, self.clock = registry, metrics, read_signals, clock
        self.points = match_profile(cfg, registry)
        self.governor = Governor(self.points, cfg.policy)
        self.tick_s = cfg.policy_tick_s
        self.signals = Signals()
        self._lock = threading.Lock()
        self._logged_broken: tuple[str, ...] = ()
        self._serving: Point | None = None  # the governor's choice once its variant is active

    @property
    def settings(self) -> PolicySettings:
        return self.governor.settings

    @property
    def point(self) -> Point | None:
        """The point serving now. While a switch loads the next variant, work still goes to the old one, under the
        old point's knobs: the governor's choice takes over only once its variant is active."""
        return self._serving

    def tick(self) -> Decision:
        """Read the signals, decide, and switch if the decision says so (blocking while the next variant loads)."""
        with self._lock:
            self.signals = self.read_signals()
            before = self.governor.current
            decision = self.governor.tick(self.clock(), self.signals)
            if decision.switched or before is None:
                variant = decision.point.settings["variant"]
                # capped before it serves: a request admitted between the switch and `_cap_rows` would otherwise
                # decode beside more rows than the point allows
                self.registry.cap_rows(variant, decision.point.settings.get(ENGINE_KNOB))
                try:
                    self.registry.activate(variant)
                except EdgekitError as err:  # keep serving what was serving; the next tick may try again
                    log.error("policy: cannot switch to %s (%s); staying", decision.point.id, err.code)
                    self.governor.current = before
                    self._cap_rows()  # the serving point's caps again
                    return decision
                if decision.switched:
                    self.metrics.policy_switches.labels(
                        decision.previous or "-", decision.point.id, decision.reason
                    ).inc()
                    log.info("policy: %s -> %s (%s)", decision.previous, decision.point.id, self._why(decision))
                    telemetry.event(
                        "edgekit.variant.switched",
                        variant=self.registry.active,
                        point=decision.point.id,
                        previous_point=decision.previous,
                        reason=decision.reason,
                    )
                self.metrics.set_active(self.registry.active, set(self.registry.specs))
            self._serving = self.governor.current
            self._cap_rows()
            if decision.broken != self._logged_broken:
                if decision.broken:
                    log.warning("policy: no point meets %s; serving %s", ", ".join(decision.broken), decision.point.id)
                self._logged_broken = decision.broken
            self.metrics.set_broken(decision.broken)
            return decision

    def _cap_rows(self) -> None:
        """The served point's batch size (`max_batch`) caps its variant's engine; every other variant (a request may
        still name one) decodes up to its configured `max_batch`. The registry keeps the cap, so a variant loaded
        between ticks starts with it, and publishes each change (`edgekitd_engine_rows_max`)."""
        serving = self._serving
        for name in self.registry.specs:
            cap = (
                serving.settings.get(ENGINE_KNOB)
                if serving is not None and serving.settings["variant"] == name
                else None
            )
            self.registry.cap_rows(name, cap)

    def _why(self, d: Decision) -> str:
        s = self.signals
        parts = [d.reason]
        if s.power_w is not None:
            parts.append(f"power {s.power_w:.1f} W ({s.power_source})")
        if s.battery_pct is not None:
            parts.append(f"battery {s.battery_pct:.0f}%{' on battery' if s.on_battery else ''}")
        if s.thermal_headroom_c is not None:
            parts.append(f"thermal headroom {s.thermal_headroom_c:.1f} C")
        parts.append(f"queue {s.queue_depth}")
        return ", ".join(parts)

    def run(self, stopped: threading.Event) -> None:
        while not stopped.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bug in one tick must not end the policy; it is logged
                log.exception("policy tick failed")

    def configure(self, settings: PolicySettings) -> Decision:
        """New settings at run time (`PUT /v1/policy`); decided on at once."""
        self.governor.configure(settings)
        log.info("policy: settings changed (mode %s)", settings.mode)
        return self.tick()

    def variant_for(self, quality: str | None, variant: str | None) -> str | None:
        """A request's override within the policy: `quality: "max"` (the best point's variant) or a variant name;
        None: no override (the active variant)."""
        if quality is None and variant is None:
            return None
        if not self.settings.allow_overrides:
            raise OverrideNotAllowedError("this daemon's policy does not allow per-request overrides")
        if quality is not None:
            if quality != "max":
                raise ConfigError(f'quality must be "max", got {quality!r}')
            return max(self.points, key=best_quality).settings["variant"]
        return variant

    def describe(self) -> dict[str, Any]:
        last = self.governor.last
        return {
            "mode": self.settings.mode,
            "modes": list(MODES),
            "settings": {
                **{k: v for k, v in asdict(self.settings).items() if k != "constraints"},
                **asdict(self.settings.constraints),
            },
            "point": self.point.id if self.point else None,
            "variant": self.registry.active,
            "decision": None
            if last is None
            else {
                "reason": last.reason,
                "broken_constraints": list(last.broken),
                "held_back": last.held_back,
                "switches": self.governor.switches,
            },
            "signals": asdict(self.signals),
            "front": [
                {
                    "id": p.id,
                    "variant": p.settings["variant"],
                    "f1": p.f1,
                    "video_f1": p.video_f1,
                    "energy_j": p.energy_j,
                    "energy_source": p.energy_source,
                    "latency_p95_ms": p.latency_p95_ms,
                    "power_w": p.power_w,
                }
                for p in self.points
            ],
        }

    def knobs(self, variant: str) -> dict[str, int]:
        """The served point's per-report knobs (`max_new_tokens`: its report-length cap; `video_max_frames`: its
        frame skipping) for work pinned to `variant` now; {} when another variant's point is served. Read once per
        report, when it is admitted, so its frames and its cap come from the same decision."""
        point = self.point
        if point is None or point.settings["variant"] != variant:
            return {}
        return {k: int(point.settings[k]) for k in PER_REPORT_KNOBS if point.settings.get(k) is not None}

    def find(self, name: str) -> Point:
        return find(self.points, name)


def capped(options: RequestOptions, knobs: dict[str, int]) -> RequestOptions:
    """`options` under the served point's report-length cap (a client's own lower cap stays)."""
    cap = knobs.get("max_new_tokens")
    if cap is None or (options.max_new_tokens is not None and options.max_new_tokens <= cap):
        return options
    return replace(options, max_new_tokens=cap)
