"""Installing a new bundle for a variant on the device: verify, stage, gate, switch, watch a canary window, then
commit or roll back by itself.

Why on the device: an over-the-air agent (Mender, RAUC, hawkBit, a fleet's own) only delivers files; whether the
new model serves as well as the old one can only be seen where it runs. The steps, each logged with its reason
and counted in /metrics (`edgekitd_rollout_steps_total`):

- **staged**: the bundle (an `.ekb`, by `POST /v1/variants/{name}/bundles` or a file dropped in `[rollout]
  drop_dir/<name>/`) is verified (signature under `[trust]`, every file against its manifest, the variant's target
  and model family) and kept beside the live one (`slots.py`);
- **gated**: it loads and warms on this device's target, writes the tokens it wrote when it was built on its own
  reference input (`reference.json`, `edgekit.reference`; a bundle built before it existed passes with the note "no
  reference outputs"), and, with `[rollout] gate_split`, scores at least `gate_min_f1` finding F1 on that held-out
  split;
- **switched**: new reports go to it; reports running keep the bundle they started on;
- **committed** after the canary window (`canary_reports` reports or `canary_s` seconds) without a breach, or
  **rolled back** to the previous bundle at the first breach: error rate, p95 latency against the previous
  bundle's own recent figures, energy per report against the profile (`EnergyBaseline`: the new bundle's point in
  `[rollout] profile`, by default the `[policy]` one, else the previous bundle's measured figure), or the SR
  delivery rate. `POST /v1/variants/{name}/rollback` does it by hand.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit.errors import EdgekitError

from .canary import PREVIOUS, PROFILE, EnergyBaseline, Figures, breach
from .config import RolloutSettings
from .slots import CANARY, COMMITTED, GATED, IDLE, ROLLED_BACK, STAGED, Slot, SlotDir, SlotState, failpoint
from .variants import Loaded, VariantRegistry

if TYPE_CHECKING:
    from edgekit.bundle import Bundle

log = logging.getLogger("edgekitd")


class RolloutError(EdgekitError):
    code = "rollout_refused"
    http_status = 422


class RolloutBusyError(EdgekitError):
    code = "rollout_in_progress"
    http_status = 409


class Rollout:
    """The rollouts of every configured variant: one at a time per variant, each step durable (`slots.py`)."""

    def __init__(
        self,
        state_dir: Path,
        registry: VariantRegistry,
        settings: Callable[[], RolloutSettings],
        count: Callable[[str, str], None],
        event: Callable[..., None] | None = None,
    ):
        self.state_dir, self.registry, self.settings = Path(state_dir), registry, settings
        self._count, self._event = count, event or (lambda *a, **k: None)
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self.windows: dict[str, Figures] = {}  # the canary window of each variant in one
        self.baselines: dict[str, Figures] = {}  # each variant's live bundle's recent figures
        self.energy: dict[str, EnergyBaseline] = {}  # what each canary window's energy is judged against

    # --- start ----------------------------------------------------------------------------------------------------
    def recover(self) -> None:
        """At start: a rollout the last run did not finish goes back to the bundle that was live before it (a staged
        bundle is discarded; an uncommitted canary rolls back), and each variant serves its live slot."""
        for name in list(self.registry.specs):
            slots = SlotDir(self.state_dir, name)
            state = slots.read()
            if state.phase in (STAGED, GATED):
                state = state.step("discarded", "the daemon restarted before the switch", staged=None, phase=IDLE)
                slots.write(state)
            elif state.phase == CANARY:
                state = self._rolled_back(state, "the daemon restarted during the canary window")
                slots.write(state)
                self._count(name, "rolled_back")
            removed = slots.clean(state)
            if removed:
                log.info("variant %s: removed %d stale slot file(s)", name, len(removed))
            if state.live is not None:
                self.registry.install(name, Path(state.live.bundle))

    # --- install ----------------------------------------------------------------------------------------------------
    def install(self, name: str, source: Path, *, move: bool = False, refused: Path | None = None) -> dict[str, Any]:
        """Verify, stage, gate and switch to the bundle at `source` (an `.ekb`, copied, or moved when `move`); the
        canary window then runs on the reports that come. A refused bundle is deleted, or moved to `refused` (a
        dropped file: the agent that dropped it finds it there). Blocking (the gate loads and warms a model)."""
        name = self.registry.check(name)
        with self._lock:
            if name in self._busy or name in self.windows:
                raise RolloutBusyError(f"variant {name!r} has a rollout in progress; wait for it or roll it back")
            self._busy.add(name)
        try:
            slots = SlotDir(self.state_dir, name)
            incoming = slots.incoming()
            (shutil.move if move else shutil.copyfile)(source, incoming)
            try:
                slot, bundle = self._verify(name, incoming)
            except BaseException:
                if refused is not None:
                    shutil.move(incoming, refused)
                incoming.unlink(missing_ok=True)
                raise
            return self._install(name, slots, incoming, slot, bundle)
        finally:
            with self._lock:
                self._busy.discard(name)

    def _install(self, name: str, slots: SlotDir, incoming: Path, slot: Slot, bundle: Bundle) -> dict[str, Any]:
        slot = dataclasses.replace(slot, bundle=str(slots.keep(incoming, slot.digest)))
        failpoint("received")
        state = slots.read().step(STAGED, staged=slot, phase=STAGED)
        slots.write(state)
        self._step(name, STAGED, f"bundle {slot.digest[:12]} staged")
        failpoint("staged")
        try:
            loaded, gate = self._gate(name, slot, bundle)
        except EdgekitError as err:
            state = slots.read().step("gate_failed", err.reason, staged=None, phase=IDLE)
            slots.write(state)
            slots.clean(state)
            self._step(name, "gate_failed", err.reason)
            raise RolloutError(f"the new bundle failed its gate: {err.reason}", code="gate_failed") from None
        slots.write(slots.read().step(GATED, json.dumps(gate), phase=GATED))
        self._step(name, GATED, json.dumps(gate))
        failpoint("gated")
        return self._switch(name, slots, slot, loaded, gate)

    def _verify(self, name: str, path: Path) -> tuple[Slot, Bundle]:
        """Signature (under [trust]), every file against the manifest, and the same target and model family as the
        bundle the variant serves now; refusals name the file and the reason."""
        from edgekit.bundle import load_bundle
        from edgekit.bundle.signing import verify_signature

        signed_by = None
        if self.registry.trusted_keys:
            signed_by = verify_signature(path, self.registry.trusted_keys).key_id
        new = load_bundle(path)
        live = self.registry.get(name).reporter.bundle
        if new.target != live.target:
            raise RolloutError(
                f"a bundle for target {new.target}; variant {name!r} serves {live.target}", path, code="wrong_target"
            )
        if _family(new) != _family(live):
            raise RolloutError(
                f"a {_family(new)} model; variant {name!r} serves a {_family(live)} model", path, code="wrong_family"
            )
        return Slot(new.digest, str(path), time.time(), signed_by), new

    def _gate(self, name: str, slot: Slot, bundle: Bundle) -> tuple[Loaded, dict[str, Any]]:
        """Load and warm on this device, the bundle's own reference check (it writes here the tokens it wrote when
        built), then the quality floor if set. `bundle`: as `_verify` checked it (not hashed a second time)."""
        loaded = self.registry.load_slot(name, Path(slot.bundle), bundle)
        try:
            gate: dict[str, Any] = {"loaded_ms": round(loaded.load_ms, 1), "warm_ms": round(loaded.warm_ms, 1)}
            gate["reference"] = self._reference(name, loaded)
            gate.update(self._quality(loaded))
        except BaseException:
            loaded.reporter.close()  # never served: nothing else holds it
            raise
        return loaded, gate

    def _reference(self, name: str, loaded: Loaded) -> dict[str, Any]:
        """`edgekit.reference.check_reference` on the engine this variant runs (its `engine` setting, else the
        target's own); a bundle without `reference.json` passes, and the log says so."""
        from edgekit.plugins import resolve_engine
        from edgekit.reference import check_reference

        reporter = loaded.reporter
        engine = self.registry.specs[name].settings.get("engine") or resolve_engine(reporter.bundle)
        result = check_reference(reporter, str(engine) if engine else None)
        if not result["checked"]:
            log.info(
                "rollout %s: gate: %s in bundle %s; the reference check passes",
                name,
                result["note"],
                loaded.digest[:12],
            )
        return result

    def _quality(self, loaded: Loaded) -> dict[str, Any]:
        s = self.settings()
        if s.gate_split is None:
            return {}
        from edgekit.eval.runner import evaluate

        result = evaluate(loaded.reporter, s.gate_split, limit=s.gate_limit, resamples=200)
        f1 = (result["overall"].get("finding_f1") or {}).get("value")
        if f1 is None or f1 < s.gate_min_f1:
            raise RolloutError(
                f"finding F1 {f1} on {result['overall']['n']} studies of the gate split, under gate_min_f1 "
                f"{s.gate_min_f1}"
            )
        return {"quality": {"finding_f1": f1, "split": str(s.gate_split), "studies": result["overall"]["n"]}}

    def _switch(self, name: str, slots: SlotDir, slot: Slot, loaded: Loaded, gate: dict) -> dict[str, Any]:
        state = slots.read()
        before = state.live or self._factory(name)
        window, energy = Figures(digest=slot.digest), self._energy_baseline(name, slot)
        state = state.step(
            "switched",
            f"energy baseline {energy.describe()}",
            live=slot,
            previous=before,
            staged=None,
            phase=CANARY,
            canary_started=window.started,
            energy_baseline=energy.to_dict(),
        )
        slots.write(state)  # from here a restart rolls back to `before` until the window commits
        failpoint("switched")
        with self._lock:
            self.windows[name], self.energy[name] = window, energy
        self.registry.install(name, Path(slot.bundle), loaded)
        live = f"bundle {slot.digest[:12]} live; canary window open; energy baseline {energy.describe()}"
        self._step(name, "switched", live)
        return {
            "variant": name,
            "phase": CANARY,
            "bundle": slot.digest,
            "gate": gate,
            "signed_by": slot.signed_by,
            "energy_baseline": energy.to_dict(),
        }

    def _energy_baseline(self, name: str, slot: Slot) -> EnergyBaseline:
        """The new bundle's point in the profile (`[rollout] profile`, by default `[policy] profile`), else the
        previous bundle's figure measured here, with the reason no profile figure was used."""
        with self._lock:
            previous = self.baselines.get(name, Figures()).mean_energy()
        path = self.settings().profile
        why = "no profile configured"
        if path is not None:
            from edgekit.pareto import read_profile

            from .policy_loop import load_time_knobs

            try:
                points = read_profile(path).points
            except EdgekitError as err:
                log.warning("rollout %s: the profile %s cannot be read (%s)", name, path, err.reason)
                points, why = [], f"{path.name} cannot be read"
            else:
                why = f"{path.name} has no point for bundle {slot.digest[:12]}"
            settings = dict(self.registry.specs[name].settings)
            ours = [
                p
                for p in points
                if p.bundle_digest == slot.digest
                and load_time_knobs(p) == settings
                and math.isfinite(p.energy_j)
                and p.energy_j > 0
            ]
            if ours:
                top = max(ours, key=lambda p: p.energy_j)
                return EnergyBaseline(PROFILE, top.energy_j, top.energy_source, f"{path.name} point {top.id}")
        return EnergyBaseline(PREVIOUS, previous, None, f"the previous bundle's mean on this device; {why}")

    def _factory(self, name: str) -> Slot:
        """The bundle the config names, as a slot (what a first rollout rolls back to)."""
        loaded = self.registry.get(name)
        return Slot(loaded.digest, str(self.registry.configured[name].bundle), factory=True)

    # --- the canary window -------------------------------------------------------------------------------------------
    def observe_report(
        self,
        variant: str,
        ok: bool,
        latency_ms: float | None,
        energy_j: float | None,
        energy_source: str | None = None,
        digest: str | None = None,
    ) -> None:
        """One report's outcome, by the bundle that wrote it (`digest`; None where the report failed before a
        bundle was held)."""
        live = self.registry.peek(variant)  # outside our lock: the registry takes its own
        with self._lock:
            figures = self._figures_for(variant, digest, live.digest if live is not None else None)
            if figures is None:
                return
            figures.reports += 1
            figures.errors += not ok
            if ok and latency_ms is not None:
                figures.latency_ms.append(latency_ms)
            if ok and energy_j is not None:
                figures.energy_j.append(energy_j)
                if energy_source:
                    figures.energy_sources.add(energy_source)
        self.judge(variant)

    def _figures_for(self, variant: str, digest: str | None, live: str | None) -> Figures | None:
        """Under the lock. What a report of bundle `digest` counts in: the canary window when the new bundle wrote
        it, else the live bundle's baseline; None for a report of a bundle no longer live (one begun before a
        switch or a rollback, which finished after it: counted, a slow bundle's last reports raised the restored
        bundle's p95 baseline, and a later slow bundle could pass its canary)."""
        window = self.windows.get(variant)
        if window is not None and (digest is None or window.digest in (None, digest)):
            return window
        if digest is not None and live is not None and digest != live:
            return None
        baseline = self.baselines.get(variant)
        if baseline is None or (digest is not None and baseline.digest not in (None, digest)):
            baseline = self.baselines[variant] = Figures(digest=digest)  # the live bundle changed without a canary
        elif baseline.digest is None:
            baseline.digest = digest
        return baseline

    def observe_delivery(self, variant: str | None, ok: bool) -> None:
        with self._lock:
            figures = self.windows.get(variant or "")
            if figures is None:
                return
            figures.delivered += ok
            figures.dead += not ok
        self.judge(variant or "")

    def judge(self, name: str, now: float | None = None) -> str | None:
        """Roll back at a breach; commit when the window is full. The outcome's step name, else None."""
        with self._lock:
            window = self.windows.get(name)
            if window is None:
                return None
            s, baseline = self.settings(), self.baselines.get(name, Figures())
            energy = self.energy.get(name)
            full = window.reports >= s.canary_reports or (now or time.time()) - window.started >= s.canary_s
            reason = breach(window, baseline, s, final=full, energy=energy)
            if reason is None and not full:
                return None
            del self.windows[name]
            self.energy.pop(name, None)
        if reason is not None:
            self.rollback(name, f"canary: {reason}", window=window)
            return ROLLED_BACK
        self._commit(name, window, (energy or EnergyBaseline(PREVIOUS, None)).against(window, baseline)[1])
        return COMMITTED

    def tick(self) -> None:
        """Once a second: windows that ran out of time, and bundles dropped in `[rollout] drop_dir`."""
        for name in list(self.windows):
            self.judge(name)
        drop = self.settings().drop_dir
        if drop is not None:
            self.scan(drop)

    def scan(self, drop: Path) -> None:
        """`<drop_dir>/<variant>/*.ekb`, written by an OTA agent and renamed into place when complete: each is
        installed (moved into the slots) or, when refused, renamed `*.ekb.refused` with the reason beside it."""
        for name in sorted(self.registry.specs):
            for path in sorted((drop / name).glob("*.ekb")) if (drop / name).is_dir() else []:
                refused = path.with_name(path.name + ".refused")
                try:
                    self.install(name, path, move=True, refused=refused)
                except RolloutBusyError:
                    return
                except EdgekitError as err:
                    log.warning("variant %s: dropped bundle %s refused: %s", name, path.name, err.reason)
                    refused.with_name(refused.name + ".txt").write_text(f"{err.code}: {err.reason}\n")

    def _commit(self, name: str, window: Figures, energy_against: str) -> None:
        slots = SlotDir(self.state_dir, name)
        state = slots.read()
        if state.phase != CANARY:
            return
        summary = json.dumps({**window.summary(), "energy_against": energy_against})
        slots.write(state.step(COMMITTED, summary, phase=COMMITTED))
        failpoint("committed")
        with self._lock:
            self.baselines[name] = window
        self._step(name, COMMITTED, summary)

    # --- rollback -----------------------------------------------------------------------------------------------------
    def rollback(self, name: str, reason: str, window: Figures | None = None) -> dict[str, Any]:
        """Serve the previous bundle again (by hand: `POST /v1/variants/{name}/rollback`)."""
        name = self.registry.check(name)
        slots = SlotDir(self.state_dir, name)
        state = slots.read()
        if state.previous is None:
            raise RolloutError(f"variant {name!r} has no previous bundle to roll back to", code="nothing_to_roll_back")
        with self._lock:
            self.windows.pop(name, None)
            self.energy.pop(name, None)
        state = self._rolled_back(state, reason)
        slots.write(state)
        self.registry.install(name, Path(state.live.bundle) if state.live else None)
        slots.clean(state)
        detail = f"{reason}" + (f" ({json.dumps(window.summary())})" if window is not None else "")
        self._step(name, "rolled_back", detail)
        digest = state.live.digest if state.live else self.registry.get(name).digest
        return {"variant": name, "phase": ROLLED_BACK, "bundle": digest, "reason": reason}

    @staticmethod
    def _rolled_back(state: SlotState, reason: str) -> SlotState:
        """The previous slot live again (None: the config's own bundle), nothing before it."""
        live = None if state.previous is None or state.previous.factory else state.previous
        return state.step(ROLLED_BACK, reason, live=live, previous=None, staged=None, phase=ROLLED_BACK)

    # --- reading ------------------------------------------------------------------------------------------------------
    def describe(self, name: str) -> dict[str, Any]:
        state = SlotDir(self.state_dir, name).read()
        out = state.to_dict()
        out["history"] = list(state.history)[-5:]
        with self._lock:
            if name in self.windows:
                out["canary"] = self.windows[name].summary()
                if name in self.energy:
                    out["canary"]["energy_against"] = self.energy[name].against(
                        self.windows[name], self.baselines.get(name, Figures())
                    )[1]
        return out

    def _step(self, name: str, step: str, reason: str) -> None:
        log.info("rollout %s: %s: %s", name, step, reason)
        self._count(name, step)
        self._event(f"edgekit.rollout.{step}", variant=name, reason=reason)


def _family(bundle) -> str:
    """What model a bundle holds, as its ModelDescription names the family, and whether it reads studies."""
    from edgekit.describe_model import describe_config

    config = json.loads(bundle.component("model_config").read_text())
    return f"{describe_config(config, bundle.name).family}{' text' if bundle.is_text else ''}"
