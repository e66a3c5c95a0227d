"""`X1Backend`: edgekit's run side over the X1 emulator — the one way x1 bundles run, so `edgekit run`, `eval`,
`profile`, edgekitd and `X1Engine` all measure the same thing.

It keeps rows of KV cache for the engine (`edgekit.engine.slots.SlotBackend`: `prefill` a row, `step` several
rows by one token each, `release` a row and get what it cost), so requests decode together: each row's token runs
through the decoder by itself (its own cache, its own head mask: the same numerics as alone) and the step is
costed as the machine executes it for all rows at once, weights streamed once (`batch_step`,
docs/x1/batching.md). The older one-sequence protocol (`decode(embeds, mask, positions, past)` with an opaque
`KVCache` as `present`/`past`, then `take_cost()`) still runs one sequence for callers that step it themselves
(parity checks, analysis).

The KV cache stays inside the emulator's SRAM-bank model (INT4 + FP16 scales, window + spill); the KV banks are
shared evenly by the rows holding a cache, so each row's resident window is its share (kv-spill.md).

Dynamic head sparsity (DSS, docs/x1/dss.md) is configured by the bundle's `runtime` section (written by the x1
build) over `RUNTIME_DEFAULTS`, then by the request's settings; a caller's `head_mask_fn` (analysis, tests)
replaces the built-in policy. Each row has its own policy and statistics (`row_state`). Prefill and the first
decode token run dense; from then on the policy (`dss.HeadMaskPolicy`) sees, per (layer, query head), the L2 norm
of that head's attention output at the last token it was computed, and returns the mask of heads to compute.

Accounting is per sequence and bounded: each emulator run adds its cycles, time and energy to its phase's sums
(encode, embed, prefill, decode; a shared step or embedding lookup adds the row's part, `accounting`);
`release(row)` or `take_cost()` returns them. The runs themselves are kept only when profiling (`keep_runs`), and
only until the sequence ends (`last_runs`: the last finished sequence's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgekit import names
from edgekit.errors import BundleError, ConfigError, TextModelError
from edgekit.target import runtime_settings

from .batch_step import StepCost, step_cost
from .dss import HeadMaskPolicy, load_head_importance
from .emulator import Emulator, KVCache, RunResult
from .machine import load_machine
from .profile_view import write_profile
from .program import load_program
from .row_state import RowState, policy_like

if TYPE_CHECKING:
    from edgekit.bundle import Bundle

PROGRAM_ROLES = {names.VISION: "x1_vision_encoder", names.EMBED: "x1_embed_tokens", names.DECODER_ROLE: "x1_decoder"}
PROGRAM_FILES = {role: Path(f).with_suffix(".x1").name for role, f in names.GRAPH_FILES.items()}
MACHINE_ROLE = "x1_machine"
DEFAULT_MAX_ROWS = 8  # rows of KV cache the engine may decode together
RUNTIME_DEFAULTS = {
    "dss": True,  # dynamic head sparsity on (skips nothing when no head falls under the threshold)
    "sparsity_target": 0.38,  # the seed's measured optimum
    "sensitivity_threshold": 0.015,
    "max_consecutive_skips": 8,
    "kv_caching": True,  # off: every token recomputes the whole sequence (dense), for comparisons
}


def check_settings(s: dict, where=None, *, label: str = "x1 runtime setting", names: dict | None = None) -> dict:
    """Types and ranges of the runtime settings; every error names the setting (as `names` spells it, for a
    caller whose fields are named otherwise, like `SparseConfig`)."""

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    checks = {
        "dss": (lambda v: isinstance(v, bool), "true or false"),
        "kv_caching": (lambda v: isinstance(v, bool), "true or false"),
        "sparsity_target": (lambda v: number(v) and 0.0 <= v < 1.0, "a number in [0, 1)"),
        "sensitivity_threshold": (lambda v: number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]"),
        "max_consecutive_skips": (
            lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1_000_000,
            "an integer >= 1",
        ),
    }
    for key, (ok, expected) in checks.items():
        if not ok(s[key]):
            name = (names or {}).get(key, key)
            raise ConfigError(f"{label} '{name}' = {s[key]!r} (expected {expected})", where)
    return s


def locate_programs(bundle_or_dir) -> tuple[dict[str, Path], Path | None, Bundle | None]:
    """Program files by graph role, the machine description the bundle carries (if any), and the bundle (None
    for a bare folder of `*.x1` files, as `edgekit x1 compile` writes)."""
    from edgekit.bundle import load_bundle

    b = bundle_or_dir
    if not hasattr(b, "component"):
        p = Path(b)
        if p.is_dir() and not (p / "manifest.json").is_file():
            files = {g: p / f for g, f in PROGRAM_FILES.items() if (p / f).is_file()}
            if not files:
                raise BundleError("no X1 programs (*.x1) in this folder", p)
            machine = p / "machine.toml"
            return files, machine if machine.is_file() else None, None
        b = load_bundle(p)
    files = {g: b.component(role) for g, role in PROGRAM_ROLES.items() if role in b.roles}
    if names.DECODER_ROLE not in files:
        raise BundleError("bundle has no X1 programs (built for another target?)", b.source)
    return files, b.component(MACHINE_ROLE) if MACHINE_ROLE in b.roles else None, b


class X1Backend:
    """The x1 run side: rows of KV cache the engine drives (`SlotBackend`), and the one-sequence protocol
    (`decode(embeds, mask, positions, past)`, `take_cost()`) for callers that step one sequence themselves.
    Rows are the engine's to hand out: one engine at a time drives a backend (two at once would both take row 0)."""

    def __init__(
        self,
        bundle_or_dir,
        machine=None,
        *,
        settings: dict | None = None,
        keep_runs: bool = False,
        head_mask_fn=None,
        max_rows: int = DEFAULT_MAX_ROWS,
    ):
        files, machine_file, bundle = locate_programs(bundle_or_dir)
        where = getattr(bundle, "source", None)
        runtime = bundle.manifest.runtime if bundle is not None else {}
        self.settings = check_settings(runtime_settings(RUNTIME_DEFAULTS, runtime, settings or {}, where), where)
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ConfigError(f"x1 max_rows = {max_rows!r} (expected an integer >= 1)", where)
        self.machine = machine if machine is not None else load_machine(machine_file)
        self.programs = {g: load_program(f, self.machine) for g, f in files.items()}
        self.emulator = Emulator(self.programs, self.machine)
        self.num_layers = self.emulator.layers
        self.kv_heads, self.head_dim = self.emulator.kv_heads, self.emulator.head_dim
        self.heads = self.emulator.heads
        if head_mask_fn is not None and not self.settings["kv_caching"]:  # recompute mode never masks heads
            raise ConfigError("head_mask_fn needs KV caching (runtime setting kv_caching=true)", where)
        if head_mask_fn is None and self.dss_active:
            head_mask_fn = HeadMaskPolicy(
                self.head_importance(bundle),
                sparsity_target=self.settings["sparsity_target"],
                sensitivity_threshold=self.settings["sensitivity_threshold"],
                max_consecutive_skips=self.settings["max_consecutive_skips"],
            )
        self.head_mask_fn = head_mask_fn
        self.policy = head_mask_fn if isinstance(head_mask_fn, HeadMaskPolicy) else None  # the one-sequence one
        self.keep_runs = keep_runs
        self.last_runs: list[tuple[str, RunResult]] = []  # the last finished sequence's runs, only with keep_runs
        # the engine's side: rows, their KV bytes as the machine holds them (INT4 + FP16 scales, every layer),
        # and what the last shared step moved, took and may move (the bandwidth rule's inputs)
        self.max_rows = max_rows
        self.kv_bytes_per_token = math.ceil(self.num_layers * self.emulator.kv_bytes_per_token)
        self.bandwidth_limit_bytes_per_s = self.machine.near_memory_bandwidth + self.machine.dram_bandwidth
        self.last_step: StepCost | None = None
        self._rows: dict[int, RowState] = {}
        self._solo = self._new_state(self.policy)

    @property
    def dss_active(self) -> bool:
        return bool(self.settings["dss"] and self.settings["sparsity_target"] > 0 and self.settings["kv_caching"])

    def head_importance(self, bundle) -> np.ndarray:
        """g (layers, heads) from the bundle's head-importance component; uniform when it has none."""
        if bundle is not None and names.HEAD_IMPORTANCE in bundle.roles:
            return load_head_importance(bundle.component(names.HEAD_IMPORTANCE), self.num_layers, self.heads)
        return np.ones((self.num_layers, self.heads))

    def _new_state(self, policy: HeadMaskPolicy | None) -> RowState:
        return RowState(self.num_layers, self.heads, policy, self.head_mask_fn)

    # the one sequence of the older protocol: its state is `_solo` -----------------------------------------
    @property
    def runs(self) -> list[tuple[str, RunResult]]:
        """The current one-sequence report's runs, only with keep_runs."""
        return self._solo.runs

    @property
    def last_mask(self) -> np.ndarray | None:
        """The one sequence's last head mask (None: its last decode ran dense)."""
        return self._solo.last_mask

    @property
    def layer_stats(self) -> np.ndarray:
        """The one sequence's latest attention-output norm of each (layer, head); NaN until computed once."""
        return self._solo.layer_stats

    @layer_stats.setter
    def layer_stats(self, value) -> None:
        self._solo.layer_stats = np.asarray(value, np.float32)

    def decode(self, inputs_embeds: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past=None):
        """One decoder call of the one sequence: `past` None starts it (prefill); otherwise the `KVCache` the last
        call returned (or (key, value) float arrays, quantised on entry); "recompute" without KV caching.
        Returns the logits of every new position and the cache after them."""
        s = self._solo
        if past is None:
            s.start()
        elif not isinstance(past, (KVCache, str)):
            s.kv = KVCache.from_arrays(list(past), self.emulator.window, self.emulator.new_kv().group)
        elif isinstance(past, KVCache):
            s.kv = past
        phase = "decode" if past is not None else "prefill"
        r = self._call(s, phase, inputs_embeds, position_ids, attention_mask, self.emulator.window)
        self._record(s, phase, r)
        logits = r.outputs[names.LOGITS]
        if not self.settings["kv_caching"]:
            return logits[:, -inputs_embeds.shape[1] :], "recompute"
        return logits, r.kv_state

    def take_cost(self) -> dict:
        """Emulated cost of everything the one sequence ran since the last call (one report), and the DSS rate
        reached; resets its accounting and policy so the next report starts from nothing."""
        s = self._solo
        cost = self._cost_of(s)
        if self.policy is not None:
            self.policy.reset()
            self.policy.reset_stats()
        self.last_runs = s.runs
        self._solo = self._new_state(self.policy)
        return cost

    # images and tokens: for rows (the engine) or for the one sequence (rows None) ------------------------
    def encode_images(self, pixel_values: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        """Image features; with `rows`, image i is row `rows[i]`'s, encoded and billed by itself."""
        if names.VISION not in self.programs:  # a text model's bundle
            raise TextModelError.no_vision_graph()
        pv = np.ascontiguousarray(pixel_values, np.float32)
        if rows is None:
            return self._encode(self._solo, pv)
        return np.concatenate([self._encode(self._row(row), pv[i : i + 1]) for i, row in enumerate(rows)])

    def _encode(self, s: RowState, pv: np.ndarray) -> np.ndarray:
        r = self.emulator.run(names.VISION, {names.PIXEL_VALUES: pv})
        self._record(s, "encode", r)
        return r.outputs[names.IMAGE_FEATURES]

    def embed(self, input_ids: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        """Embeddings of (n, seq) ids in one run; with `rows`, row `rows[i]` is billed 1/n of it (its ids)."""
        r = self.emulator.run(names.EMBED, {names.INPUT_IDS: np.ascontiguousarray(input_ids, np.int64)})
        states = [self._solo] if rows is None else [self._row(row) for row in rows]
        for s in states:
            self._record(s, "embed", r, share=1.0 / len(states))
        return r.outputs[names.INPUTS_EMBEDS]

    # rows (edgekit.engine.slots.SlotBackend) --------------------------------------------------------------
    def prefill(self, row: int, inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Append a prompt (or a chunk of one) to `row`'s cache, dense; the logits of its last position."""
        s = self._row(row)
        if not s.started:
            s.start()
        r = self._call(s, "prefill", inputs_embeds, position_ids, None, self._window(extra=not s.started))
        self._record(s, "prefill", r)
        return r.outputs[names.LOGITS][0, -1]

    def prefill_rows(self, rows: Sequence[int], inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """The whole first prompts of new `rows` ((n, seq, hidden), positions (n, seq) or M-RoPE's (3, n, seq)),
        costed as the one prefill the machine runs for all of them: its weight GEMMs over every row's tokens at
        once (`batch_step`), the weights streamed once. Each row runs by itself, in order, exactly as its own
        `prefill` would (its numerics and its share of the KV banks), so its tokens are those it gets alone."""
        states = [self._row(row) for row in rows]
        if any(s.started for s in states):
            raise ConfigError("prefill_rows takes new rows only (a row with a cache prefills alone)")
        runs = []
        for i, s in enumerate(states):
            s.start()
            x, at = inputs_embeds[i : i + 1], position_ids[..., i : i + 1, :]
            runs.append(self._call(s, "prefill", x, at, None, self._window(extra=True)))
        shared = step_cost(self.emulator, names.DECODER_ROLE, runs, [None] * len(runs))
        for i, (s, r) in enumerate(zip(states, runs)):
            s.cost.add_step("prefill", shared, i)
            if self.keep_runs:
                s.runs.append(("prefill", r))
        return np.concatenate([r.outputs[names.LOGITS][:, -1] for r in runs])

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """One token for each of `rows`, each against its own cache with its own head mask (one emulator run per
        row: numerics exactly those of the row alone), costed as the one step the machine executes for all of
        them (`batch_step`) and attributed to the rows."""
        states = [self._row(row) for row in rows]
        window = self._window()
        runs, masks = [], []
        for i, s in enumerate(states):
            r = self._call(s, "decode", inputs_embeds[i : i + 1], position_ids[..., i : i + 1, :], None, window)
            runs.append(r)
            masks.append(s.last_mask)
        step = self.last_step = step_cost(self.emulator, names.DECODER_ROLE, runs, masks)
        for i, (s, r) in enumerate(zip(states, runs)):
            s.cost.add_step("decode", step, i)
            if self.keep_runs:
                s.runs.append(("decode", r))
        return np.concatenate([r.outputs[names.LOGITS][:, -1] for r in runs])

    def release(self, row: int) -> dict:
        """Forget `row`'s cache and state; what it cost since it was first used ({} for a row never used)."""
        s = self._rows.pop(row, None)
        if s is None:
            return {}
        if self.keep_runs:
            self.last_runs = s.runs
        return self._cost_of(s)

    @property
    def last_step_bytes(self) -> float | None:
        """Bytes the last step moved off chip (weight stream and external DRAM): the bandwidth rule's count."""
        return None if self.last_step is None else self.last_step.off_chip_bytes

    @property
    def last_step_seconds(self) -> float | None:
        """The last step's emulated time (the whole step: every row's token)."""
        return None if self.last_step is None else self.last_step.seconds

    def _row(self, row: int) -> RowState:
        s = self._rows.get(row)
        if s is None:
            if not 0 <= row < self.max_rows:
                raise ConfigError(f"x1 row {row} is outside this backend's {self.max_rows} rows")
            s = self._rows[row] = self._new_state(None if self.policy is None else policy_like(self.policy))
        return s

    def _window(self, extra: bool = False) -> int:
        """Each live row's share of the KV banks, in tokens per layer (kv-spill.md's window over the rows holding
        a cache; `extra`: one more is about to)."""
        live = sum(1 for s in self._rows.values() if s.started) + int(extra)
        return max(1, self.emulator.window // max(1, live))

    # one decoder call ---------------------------------------------------------------------------------------
    def _call(self, s: RowState, phase: str, x, positions, attention_mask, window: int) -> RunResult:
        """Run `x` (1, seq, hidden) after `s`'s positions; `s` moves on (cache, length, statistics). Prefill and
        the first decode token run dense; later decode tokens with `s`'s head mask. Without KV caching every
        call recomputes the whole sequence, dense, over an empty cache."""
        x = np.ascontiguousarray(x, np.float32)
        positions = np.asarray(positions)
        mask = None
        if not self.settings["kv_caching"]:
            if s.seq is not None:
                x = np.concatenate([s.seq[0], x], axis=1)
                positions = np.concatenate([s.seq[1], positions], axis=-1)  # (b, seq) or M-RoPE's (3, b, seq)
            s.seq = (x, positions)
            kv = _sized(self.emulator.new_kv(), window)
        else:
            kv = _sized(self.emulator.new_kv() if s.kv is None else s.kv, window)
            if phase == "decode":
                mask = s.next_mask()
            else:
                s.last_mask = None
        if attention_mask is None:
            attention_mask = np.ones((x.shape[0], s.length + x.shape[1] if s.seq is None else x.shape[1]), np.int64)
        feeds = {
            names.INPUTS_EMBEDS: x,
            names.ATTENTION_MASK: np.ascontiguousarray(attention_mask, np.int64),
            names.POSITION_IDS: np.ascontiguousarray(positions, np.int64),
        }
        r = self.emulator.run(names.DECODER_ROLE, feeds, head_mask=mask, kv_state=kv, want_present=False)
        s.observe(r.head_norms if s.mask_fn is not None else None)
        s.kv = r.kv_state if self.settings["kv_caching"] else None
        s.length = x.shape[1] if s.seq is not None else s.length + x.shape[1]
        if phase == "decode":
            s.decode_tokens += 1
        return r

    # accounting ---------------------------------------------------------------------------------------------
    def _record(self, s: RowState, phase: str, r: RunResult, share: float = 1.0) -> None:
        s.cost.add_run(phase, r, share=share, decoding=s.started)
        if self.keep_runs:
            s.runs.append((phase, r))

    def _cost_of(self, s: RowState) -> dict:
        cost = {
            **s.cost.summary(),
            "figure_source": "emulated:x1",
            "kv_caching": self.settings["kv_caching"],
            "sparsity_target": self.settings["sparsity_target"] if self.dss_active else 0.0,
            "skip_rate": 0.0,
            "machine": {"name": self.machine.machine.name, "hash": self.machine.hash},
            "source": f"edgekit x1 emulator, machine {self.machine.machine.name} ({self.machine.short_hash}): "
            "emulated cycles and energy per instruction",
        }
        if s.policy is not None:
            cost["dss"] = s.policy.report()
            cost["skip_rate"] = s.policy.stats.skip_rate
        return cost

    def write_profile(self, report, out: Path) -> dict:
        """The last report's runs as a chrome trace, per-op / layer / token / layer-type tables and a plot."""
        return write_profile(self, report, out)


def _sized(kv: KVCache, window: int) -> KVCache:
    """`kv` with a resident window of `window` tokens per layer (a copy when it differs: states are immutable)."""
    if kv.window == window:
        return kv
    kv = kv.copy()
    kv.window = window
    return kv
