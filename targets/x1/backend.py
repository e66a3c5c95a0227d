"""`X1Backend`: edgekit's generation backend protocol over the X1 emulator — the one way x1 bundles run, so
`edgekit run`, `eval`, `profile`, edgekitd and `X1Engine` all measure the same thing.

The KV cache stays inside the emulator's SRAM-bank model (INT4 + FP16 scales, window + spill): `decode` returns
an opaque `KVCache` as `present` and takes it back as `past` (a list of (key, value) float arrays is accepted too,
and quantised on entry).

Dynamic head sparsity (DSS, docs/x1/dss.md) is configured by the bundle's `runtime` section (written by the x1
build) over `RUNTIME_DEFAULTS`, then by the request's settings; a caller's `head_mask_fn` (analysis, tests)
replaces the built-in policy. Prefill and the first decode token run dense; from
then on the policy (`dss.HeadMaskPolicy`) sees, per (layer, query head), the L2 norm of that head's attention
output at the last token it was computed, and returns the mask of heads to compute.

Accounting is per report and bounded: each emulator run adds its cycles, time and energy to its phase's sums
(encode, embed, prefill, decode); `take_cost()` returns them and starts afresh. The instruction records of each
run are kept only when profiling (`keep_runs`), and only until the next `take_cost()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgekit import names
from edgekit.errors import BundleError, ConfigError, TextModelError
from edgekit.target import runtime_settings

from .dss import HeadMaskPolicy, load_head_importance
from .emulator import Emulator, KVCache, RunResult
from .machine import load_machine
from .program import load_program

PROGRAM_ROLES = {names.VISION: "x1_vision_encoder", names.EMBED: "x1_embed_tokens", names.DECODER_ROLE: "x1_decoder"}
PROGRAM_FILES = {role: Path(f).with_suffix(".x1").name for role, f in names.GRAPH_FILES.items()}
MACHINE_ROLE = "x1_machine"
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


def locate_programs(bundle_or_dir) -> tuple[dict[str, Path], Path | None, object | None]:
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


@dataclass
class PhaseCost:
    calls: int = 0
    cycles: float = 0.0
    seconds: float = 0.0
    energy_j: float = 0.0

    def add(self, r: RunResult) -> None:
        self.calls += 1
        self.cycles += float(r.totals["cycles"])
        self.seconds += float(r.totals["seconds"])
        self.energy_j += float(r.totals["energy_j"])


@dataclass
class ReportCost:
    """What one report cost on the emulated X1, by phase; a decoded token costs its decoder call plus its
    embedding lookup (the prefill's token costs the prefill)."""

    phases: dict[str, PhaseCost] = field(default_factory=dict)
    decode_embed: PhaseCost = field(default_factory=PhaseCost)  # embedding lookups of decoded tokens

    def add(self, phase: str, r: RunResult) -> None:
        self.phases.setdefault(phase, PhaseCost()).add(r)


class X1Backend:
    """`encode_images`, `embed`, `decode` on the emulator, DSS as configured, cost per report."""

    def __init__(
        self, bundle_or_dir, machine=None, *, settings: dict | None = None, keep_runs: bool = False, head_mask_fn=None
    ):
        files, machine_file, bundle = locate_programs(bundle_or_dir)
        where = getattr(bundle, "source", None)
        runtime = bundle.manifest.runtime if bundle is not None else {}
        self.settings = check_settings(runtime_settings(RUNTIME_DEFAULTS, runtime, settings or {}, where), where)
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
        self.policy = head_mask_fn if isinstance(head_mask_fn, HeadMaskPolicy) else None
        self.keep_runs = keep_runs
        self.runs: list[tuple[str, RunResult]] = []  # this report's runs, only with keep_runs
        self.last_runs: list[tuple[str, RunResult]] = []  # the last finished report's runs, only with keep_runs
        self.last_mask: np.ndarray | None = None
        self._cost = ReportCost()
        self._layer_stats = np.full((self.num_layers, self.heads), np.nan, np.float32)
        self._decoder_calls = 0  # of this sequence, the prefill included
        self._seq: tuple[np.ndarray, np.ndarray] | None = None  # (embeds, positions) without KV caching

    @property
    def dss_active(self) -> bool:
        return bool(self.settings["dss"] and self.settings["sparsity_target"] > 0 and self.settings["kv_caching"])

    def head_importance(self, bundle) -> np.ndarray:
        """g (layers, heads) from the bundle's head-importance component; uniform when it has none."""
        if bundle is not None and names.HEAD_IMPORTANCE in bundle.roles:
            return load_head_importance(bundle.component(names.HEAD_IMPORTANCE), self.num_layers, self.heads)
        return np.ones((self.num_layers, self.heads))

    @property
    def layer_stats(self) -> np.ndarray:
        """The latest attention-output norm of each (layer, head); NaN until the head was computed once."""
        return self._layer_stats

    @layer_stats.setter
    def layer_stats(self, value) -> None:
        self._layer_stats = np.asarray(value, np.float32)

    def _record(self, phase: str, r: RunResult) -> RunResult:
        self._cost.add(phase, r)
        if phase == "embed" and self._decoder_calls:
            self._cost.decode_embed.add(r)
        if self.keep_runs:
            self.runs.append((phase, r))
        return r

    # the backend protocol ------------------------------------------------------------------------------------
    def encode_images(self, pixel_values: np.ndarray) -> np.ndarray:
        if names.VISION not in self.programs:  # a text model's bundle
            raise TextModelError.no_vision_graph()
        feeds = {names.PIXEL_VALUES: np.ascontiguousarray(pixel_values, np.float32)}
        return self._record("encode", self.emulator.run(names.VISION, feeds)).outputs[names.IMAGE_FEATURES]

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        feeds = {names.INPUT_IDS: np.ascontiguousarray(input_ids, np.int64)}
        return self._record("embed", self.emulator.run(names.EMBED, feeds)).outputs[names.INPUTS_EMBEDS]

    def decode(self, inputs_embeds: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past=None):
        if past is None:
            return self._prefill(inputs_embeds, attention_mask, position_ids)
        if not self.settings["kv_caching"]:  # recompute the whole sequence, dense
            x = np.concatenate([self._seq[0], inputs_embeds], axis=1)
            pos = np.concatenate([self._seq[1], position_ids], axis=-1)  # (batch, seq) or M-RoPE's (3, batch, seq)
            self._seq = (x, pos)
            logits, _ = self._run_decoder("decode", x, attention_mask, pos, self.emulator.new_kv(), None)
            self._decoder_calls += 1
            return logits[:, -inputs_embeds.shape[1] :], "recompute"
        kv = (
            past
            if isinstance(past, KVCache)
            else KVCache.from_arrays(list(past), self.emulator.window, self.emulator.new_kv().group)
        )
        if self.policy is not None:
            self.policy.begin_decode()
        mask = None
        if self.head_mask_fn is not None and self._decoder_calls >= 2:  # dss.md: prefill and the first decode
            mask = self.head_mask_fn(self._layer_stats.copy())  # token run dense (no statistics yet)
        self.last_mask = None if mask is None else np.asarray(mask, bool)
        out = self._run_decoder("decode", inputs_embeds, attention_mask, position_ids, kv, self.last_mask)
        self._decoder_calls += 1
        return out

    def _prefill(self, inputs_embeds, attention_mask, position_ids):
        self._decoder_calls = 1
        if self.policy is not None:
            self.policy.begin_prefill()
        if not self.settings["kv_caching"]:
            self._seq = (np.asarray(inputs_embeds), np.asarray(position_ids))
        self.last_mask = None
        return self._run_decoder("prefill", inputs_embeds, attention_mask, position_ids, self.emulator.new_kv(), None)

    def _run_decoder(self, phase, inputs_embeds, attention_mask, position_ids, kv, mask):
        feeds = {
            names.INPUTS_EMBEDS: np.ascontiguousarray(inputs_embeds, np.float32),
            names.ATTENTION_MASK: np.ascontiguousarray(attention_mask, np.int64),
            names.POSITION_IDS: np.ascontiguousarray(position_ids, np.int64),
        }
        r = self._record(
            phase, self.emulator.run(names.DECODER_ROLE, feeds, head_mask=mask, kv_state=kv, want_present=False)
        )
        if self.head_mask_fn is not None and r.head_norms is not None:  # only a policy reads them (lazy)
            self._layer_stats = np.where(np.isnan(r.head_norms), self._layer_stats, r.head_norms).astype(np.float32)
        return r.outputs[names.LOGITS], r.kv_state

    # per-report accounting -----------------------------------------------------------------------------------
    def take_cost(self) -> dict:
        """Emulated cost of everything run since the last call (one report), and the DSS rate reached; resets
        the accounting and the policy so the next report starts from nothing."""
        c = self._cost
        phases = c.phases
        decode = phases.get("decode", PhaseCost())
        steps = decode.calls
        total_s = sum(p.seconds for p in phases.values())
        total_j = sum(p.energy_j for p in phases.values())
        cost = {
            "decode_steps": steps,
            "emulated_ms_per_token": (decode.seconds + c.decode_embed.seconds) / steps * 1e3 if steps else 0.0,
            "mj_per_token": (decode.energy_j + c.decode_embed.energy_j) / steps * 1e3 if steps else 0.0,
            "emulated_ms_total": total_s * 1e3,
            "mj_total": total_j * 1e3,
            # what the reporter bills: the device's own latency and energy, not the host's running the emulator
            "latency_ms": total_s * 1e3,
            "energy_j": total_j,
            "figure_source": "emulated:x1",
            "phases": {k: {"calls": v.calls, "ms": v.seconds * 1e3, "mj": v.energy_j * 1e3} for k, v in phases.items()},
            "kv_caching": self.settings["kv_caching"],
            "sparsity_target": self.settings["sparsity_target"] if self.dss_active else 0.0,
            "skip_rate": 0.0,
            "machine": {"name": self.machine.machine.name, "hash": self.machine.hash},
            "source": f"edgekit x1 emulator, machine {self.machine.machine.name} ({self.machine.short_hash}): "
            "emulated cycles and energy per instruction",
        }
        if self.policy is not None:
            cost["dss"] = self.policy.report()
            cost["skip_rate"] = self.policy.stats.skip_rate
            self.policy.reset()
            self.policy.reset_stats()
        self._cost = ReportCost()
        self.last_runs, self.runs = self.runs, []
        self._seq, self._decoder_calls, self.last_mask = None, 0, None
        self._layer_stats = np.full((self.num_layers, self.heads), np.nan, np.float32)
        return cost

    def write_profile(self, report, out: Path) -> dict:
        """The last report's runs as a chrome trace, per-op / layer / token / layer-type tables and a plot."""
        from .trace import write_profile

        if not self.keep_runs:
            raise ConfigError("this x1 backend was not loaded for profiling (profile_dir not given)")
        cost = report.cost
        m = self.machine
        tokens = report.timings["new_tokens"]
        tables = write_profile(
            self.last_runs,
            m.hz,
            out,
            machine=m.machine.name,
            title=f"{report.model} on x1 ({m.machine.name}): one report, {tokens} tokens, "
            f"{cost['emulated_ms_total']:.2f} ms, {cost['mj_total']:.2f} mJ emulated",
        )
        dss = cost.get("dss", {"sparsity_target": 0.0, "skip_rate": 0.0})
        # where the importance DSS ranks heads by came from: uniform (no scores in the bundle) ranks none above another
        g = self.policy.importance if self.policy is not None else None
        importance = (
            "a caller's head mask"
            if g is None
            else "uniform head importance: the bundle has none"
            if np.all(g == g.flat[0])
            else "head importance from the bundle"
        )
        return {
            "summary": {
                "emulated ms / report": round(cost["emulated_ms_total"], 3),
                "mJ / report": round(cost["mj_total"], 3),
                "emulated ms / token": round(cost["emulated_ms_per_token"], 4),
                "mJ / token": round(cost["mj_per_token"], 4),
                "tokens": tokens,
                "DSS": (
                    f"on ({importance}), skip rate {cost['skip_rate']:.3f} of target {cost['sparsity_target']:.2f}"
                    if self.dss_active
                    else "off"
                ),
            },
            "summary_title": f"x1 emulated, machine {m.machine.name} ({m.short_hash})",
            "tables": {
                "per layer": [
                    {"layer": r["layer"], "ms": round(r["ms"], 4), "mJ": round(r["mj"], 4), "bound": r["bound"]}
                    for r in tables["layers"]
                ],
                "by layer type": [
                    {
                        "layer type": r["layer_type"],
                        "ms": round(r["ms"], 4),
                        "mJ": round(r["mj"], 4),
                        "bound": r["bound"],
                    }
                    for r in tables["layer_types"][:12]
                ],
            },
            "details": {
                "machine": cost["machine"],
                "per_report": {"emulated_ms": cost["emulated_ms_total"], "mj": cost["mj_total"], "tokens": tokens},
                "per_token": {"emulated_ms": cost["emulated_ms_per_token"], "mj": cost["mj_per_token"]},
                "dss": dss,
                "phases": cost["phases"],
                "layers": [{k: r[k] for k in ("layer", "ms", "mj", "bound", "time_share")} for r in tables["layers"]],
                "layer_types": [
                    {k: r[k] for k in ("layer_type", "ms", "mj", "bound", "time_share")} for r in tables["layer_types"]
                ],
            },
            "files": tables["paths"],
            "trace": str(out / "trace.json"),
            "plot": str(out / "layer_types.png"),
            "source": cost["source"] + ", one report",
        }
