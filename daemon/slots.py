"""A variant's bundle slots on disk: the live one, the one before it, one staged beside them, and the phase of the
rollout between them, in one small JSON file replaced atomically.

Why one file, written last: `kill -9` (or a power cut) can land at any step of a rollout. A bundle file only ever
appears under its final name complete and fsynced (`slots/<digest>.ekb`, renamed from a temporary name), and the
state file names which slot is live only after that; so a restart finds either the old state (the old bundle live,
a staged one at most, discarded) or the new one. A rollout still in its canary window when the daemon stopped was
never committed: the restart rolls it back, as Mender and RAUC treat an update that was not marked good.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edgekit.bundle.io import replace_file

from .uploads import fsync_dir

STATE_NAME = "state.json"
INCOMING_PREFIX = ".incoming-"
HISTORY = 20  # steps kept in the state file (the log and /metrics keep them all)
IDLE, STAGED, GATED, CANARY, COMMITTED, ROLLED_BACK = "idle", "staged", "gated", "canary", "committed", "rolled_back"
FAILPOINT_ENV = "EDGEKIT_FAILPOINT"


def failpoint(name: str) -> None:
    """`EDGEKIT_FAILPOINT=<name>` kills the daemon right here with SIGKILL: how the tests put `kill -9` at every
    step of a rollout. Never set in production; a no-op unless it names this point."""
    if os.environ.get(FAILPOINT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Slot:
    """One bundle file of a variant: its manifest digest names it."""

    digest: str
    bundle: str  # slots/<digest>.ekb, or the config's own bundle for the factory slot
    since: float = 0.0
    signed_by: str | None = None
    factory: bool = False  # the bundle the config names (what a first rollout goes back to)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Slot | None:
        if not d:
            return None
        return cls(
            str(d["digest"]), str(d["bundle"]), float(d.get("since", 0)), d.get("signed_by"), bool(d.get("factory"))
        )


@dataclass(frozen=True)
class SlotState:
    """What `state.json` holds for one variant."""

    live: Slot | None = None  # None: the bundle the config names
    previous: Slot | None = None  # what a rollback goes back to
    staged: Slot | None = None
    phase: str = IDLE
    canary_started: float | None = None
    # what the last canary's energy per report was judged against (canary.EnergyBaseline.to_dict())
    energy_baseline: dict[str, Any] | None = None
    history: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def step(self, step: str, reason: str = "", **changes: Any) -> SlotState:
        entry = {"step": step, "at": round(time.time(), 3), **({"reason": reason} if reason else {})}
        return replace(self, **changes, history=(*self.history, entry)[-HISTORY:])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["history"] = list(self.history)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SlotState:
        return cls(
            live=Slot.from_dict(d.get("live")),
            previous=Slot.from_dict(d.get("previous")),
            staged=Slot.from_dict(d.get("staged")),
            phase=str(d.get("phase", IDLE)),
            canary_started=d.get("canary_started"),
            energy_baseline=d.get("energy_baseline"),
            history=tuple(d.get("history", ())),
        )


class SlotDir:
    """`<state_dir>/variants/<name>/`: the slot files and the state file of one variant."""

    def __init__(self, root: Path, name: str):
        self.root = Path(root) / "variants" / name
        self.slots = self.root / "slots"

    def read(self) -> SlotState:
        try:
            return SlotState.from_dict(json.loads((self.root / STATE_NAME).read_text()))
        except FileNotFoundError:
            return SlotState()

    def write(self, state: SlotState) -> None:
        """Replace the state file atomically: a temporary file fsynced, renamed, the directory fsynced."""
        self.root.mkdir(parents=True, exist_ok=True)
        replace_file(self.root / STATE_NAME, json.dumps(state.to_dict(), indent=2) + "\n")

    def incoming(self) -> Path:
        """A fresh temporary name for a bundle being received (never taken for a slot: its name starts with '.')."""
        self.slots.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=INCOMING_PREFIX, suffix=".ekb", dir=self.slots)
        os.close(fd)
        return Path(name)

    def keep(self, incoming: Path, digest: str) -> Path:
        """The received file, fsynced, under its slot name (atomic rename, the directory fsynced after)."""
        with open(incoming, "rb") as f:
            os.fsync(f.fileno())
        final = self.slots / f"{digest[:32]}.ekb"
        os.replace(incoming, final)
        fsync_dir(self.slots)
        return final

    def clean(self, state: SlotState) -> list[str]:
        """Remove temporary files and slot files the state no longer names; the names removed."""
        if not self.slots.is_dir():
            return []
        keep = {Path(s.bundle).name for s in (state.live, state.previous, state.staged) if s is not None}
        gone = []
        for p in self.slots.iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)
                gone.append(p.name)
        return gone
