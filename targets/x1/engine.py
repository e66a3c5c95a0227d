"""The X1 runtime API: `SparseConfig` and `X1Engine`, shaped so the seed's SDK snippet runs as written.

    config = SparseConfig(sparsity_target=0.38, sensitivity_threshold=0.015, enable_kv_caching=True)
    engine = X1Engine(model_path="radreport-tiny-x1", config=config)
    output = engine.generate(input_ids=input_tokens, max_new_tokens=128, temperature=0.7)

Why a thin layer over `X1Backend`: the backend is edgekit's generation protocol on the emulator; the engine adds
what a user of the chip asks for: the DSS policy plugged into the backend (`targets/x1/dss.py`), text-only
generation from token ids, the study -> report entry the daemon uses, and `last_stats` (emulated time and
energy per token, the skip rate reached against the target) so every call says what it cost on the X1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.bundle import Bundle, cache_dir, load_bundle
from edgekit.errors import BundleError, ConfigError, EdgekitError
from edgekit.generate import GenerationOptions, next_tokens

from .dss import HEAD_IMPORTANCE_FILE, HeadMaskPolicy, load_head_importance

BUNDLE_PATH_ENV = "EDGEKIT_BUNDLE_PATH"


@dataclass(frozen=True)
class SparseConfig:
    """How the X1 runs a model. `sparsity_target`: the most heads DSS may skip per token (fraction of all);
    `sensitivity_threshold`: a head is a candidate when importance x output share is below it;
    `enable_kv_caching`: keep K/V between tokens (off: every token recomputes the whole sequence, dense);
    `enable_sparsity`: False runs dense (DSS off) with the same engine, for comparisons;
    `max_consecutive_skips`: anti-starvation (dss.md); `machine`: a machine-description TOML (None: default)."""

    sparsity_target: float = 0.38
    sensitivity_threshold: float = 0.015
    enable_kv_caching: bool = True
    enable_sparsity: bool = True
    max_consecutive_skips: int = 8
    machine: str | None = None

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> ConfigError:
            return ConfigError(f"SparseConfig field '{field}' = {getattr(self, field)!r} (expected {expected})")

        num = (int, float)
        if isinstance(self.sparsity_target, bool) or not isinstance(self.sparsity_target, num) \
                or not 0.0 <= self.sparsity_target < 1.0:
            raise bad("sparsity_target", "a number with 0 <= target < 1")
        if isinstance(self.sensitivity_threshold, bool) or not isinstance(self.sensitivity_threshold, num) \
                or not 0.0 <= self.sensitivity_threshold <= 1.0:
            raise bad("sensitivity_threshold", "a number with 0 <= threshold <= 1 (a share of a layer's output)")
        for flag in ("enable_kv_caching", "enable_sparsity"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "True or False")
        if isinstance(self.max_consecutive_skips, bool) or not isinstance(self.max_consecutive_skips, int) \
                or not 1 <= self.max_consecutive_skips <= 1_000_000:
            raise bad("max_consecutive_skips", "an integer >= 1")
        if self.machine is not None and not isinstance(self.machine, (str, os.PathLike)):
            raise bad("machine", "a path to a machine-description TOML or None")

    @property
    def dss_active(self) -> bool:
        return self.enable_sparsity and self.sparsity_target > 0


def resolve_bundle(model_path: str | os.PathLike | Bundle) -> Bundle:
    """A bundle from a directory, an `.ekb`, or a name looked up (as `NAME`, `NAME.ekb`, `NAME-x1`,
    `NAME-x1.ekb`) in `$EDGEKIT_BUNDLE_PATH` (os.pathsep-separated), `./out` and `<edgekit cache>/bundles`."""
    if isinstance(model_path, Bundle):
        return model_path
    p = Path(model_path)
    if p.exists():
        return load_bundle(p)
    name = str(model_path)
    if os.sep in name or (os.altsep and os.altsep in name):
        raise BundleError("bundle not found", p)
    roots = [Path(d) for d in os.environ.get(BUNDLE_PATH_ENV, "").split(os.pathsep) if d]
    roots += [Path.cwd() / "out", cache_dir() / "bundles"]
    for root in roots:
        for cand in (name, f"{name}.ekb", f"{name}-x1", f"{name}-x1.ekb"):
            if (root / cand).exists():
                return load_bundle(root / cand)
    raise BundleError(f"no bundle named {name!r} in {', '.join(str(r) for r in roots)} "
                      f"(give a bundle directory or .ekb, or set {BUNDLE_PATH_ENV})")


def _total(result, key: str) -> float:
    totals = getattr(result, "totals", None)
    if isinstance(totals, dict):
        return float(totals.get(key, 0.0))
    return float(getattr(totals, key, 0.0))


class _PhasedBackend:
    """The X1 backend seen by `generate`: tells the DSS policy whether a call is prefill or decode, tags each
    emulator run with its phase, and (without KV caching) turns a decode step into a full recompute."""

    def __init__(self, inner, policy: HeadMaskPolicy | None, kv_caching: bool):
        self.inner, self.policy, self.kv_caching = inner, policy, kv_caching
        self.runs: list[tuple[str, object]] = []  # (phase, RunResult)
        self._seq: tuple[np.ndarray, np.ndarray] | None = None  # (embeds, positions) when not caching

    def _tagged(self, phase: str, fn, *args):
        history = getattr(self.inner, "history", None)
        before = len(history) if history is not None else 0
        out = fn(*args)
        if history is not None:
            self.runs += [(phase, r) for r in history[before:]]
        return out

    def encode_images(self, pixel_values):
        return self._tagged("encode", self.inner.encode_images, pixel_values)

    def embed(self, input_ids):
        return self._tagged("embed", self.inner.embed, input_ids)

    def decode(self, inputs_embeds, attention_mask, position_ids, past):
        if past is None:
            if self.policy is not None:
                self.policy.begin_prefill()
            self._seq = (np.asarray(inputs_embeds), np.asarray(position_ids))
            return self._tagged("prefill", self.inner.decode, inputs_embeds, attention_mask, position_ids, None)
        if not self.kv_caching:
            x = np.concatenate([self._seq[0], inputs_embeds], axis=1)
            pos = np.concatenate([self._seq[1], position_ids], axis=1)
            self._seq = (x, pos)
            logits, _ = self._tagged("decode", self.inner.decode, x, attention_mask, pos, None)
            return logits[:, -inputs_embeds.shape[1]:], "recompute"
        if self.policy is not None:
            self.policy.begin_decode()
        return self._tagged("decode", self.inner.decode, inputs_embeds, attention_mask, position_ids, past)


class X1Engine:
    """An x1 bundle on the emulated X1, with DSS as configured. One engine per model; not thread-safe."""

    def __init__(self, model_path: str | os.PathLike | Bundle, config: SparseConfig | None = None, *,
                 machine=None):
        from edgekit.models.radreport_tiny.config import ModelConfig

        from .machine import load_machine

        self.config = config if config is not None else SparseConfig()
        if not isinstance(self.config, SparseConfig):
            raise ConfigError(f"config must be a SparseConfig, got {type(self.config).__name__}")
        self.bundle = resolve_bundle(model_path)
        if self.bundle.target != "x1":
            raise BundleError(f"bundle is built for target '{self.bundle.target}', not x1 "
                              "(build one with: edgekit build --target x1)", self.bundle.source)
        self.machine = machine if machine is not None else load_machine(self.config.machine)
        self.model_config = ModelConfig.load(self.bundle.component("model_config"))
        self.generation_config = json.loads(self.bundle.component("generation_config").read_text())
        self.policy: HeadMaskPolicy | None = None
        if self.config.dss_active and self.config.enable_kv_caching:
            self.policy = HeadMaskPolicy(
                self.head_importance(), sparsity_target=self.config.sparsity_target,
                sensitivity_threshold=self.config.sensitivity_threshold,
                max_consecutive_skips=self.config.max_consecutive_skips)
        from .backend import X1Backend  # after the checks: a wrong bundle fails fast, before any compile

        self.x1_backend = X1Backend(self.bundle, self.machine, head_mask_fn=self.policy)
        self.backend = _PhasedBackend(self.x1_backend, self.policy, self.config.enable_kv_caching)
        self._reporter = None
        self.last_stats: dict = {}

    def head_importance(self) -> np.ndarray:
        """g (layers, heads) from the bundle's `head_importance.json` (a component or a file at its root);
        uniform when the bundle has none."""
        c = self.model_config
        path = None
        if "head_importance" in self.bundle.manifest.components:
            path = self.bundle.component("head_importance")
        elif (self.bundle.root / HEAD_IMPORTANCE_FILE).is_file():
            path = self.bundle.root / HEAD_IMPORTANCE_FILE
        return load_head_importance(path, c.layers, c.heads) if path else np.ones((c.layers, c.heads))

    # text only: the seed's snippet -----------------------------------------------------------------------------
    def generate(self, input_ids, max_new_tokens: int = 128, temperature: float = 0.7, *, top_p: float = 1.0,
                 seed: int | None = None, stop_token_ids=None) -> list[int]:
        """New token ids after `input_ids` (a list or array of ids, (seq,) or (1, seq)), stopping at the
        bundle's `<eos>` (or `stop_token_ids`). Sampling is seeded by `seed`; temperature 0 is greedy."""
        ids = np.asarray(input_ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise EdgekitError(f"input_ids must be a non-empty list or (seq,) / (1, seq) array of integer token "
                               f"ids, got dtype {ids.dtype} shape {ids.shape}")
        vocab = self.model_config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise EdgekitError(f"input_ids must lie in [0, {vocab}) for this model, got "
                               f"[{int(ids.min())}, {int(ids.max())}]")
        stops = [self.generation_config["eos_token_id"]] if stop_token_ids is None else list(stop_token_ids)
        options = GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    seed=seed, stop_token_ids=stops)
        ids = ids.astype(np.int64)[None]
        self._begin()
        rng = np.random.default_rng(seed)
        b = self.backend
        n = ids.shape[1]
        mask = np.ones((1, n), np.int64)
        logits, past = b.decode(b.embed(ids), mask, np.arange(n, dtype=np.int64)[None], None)
        out: list[int] = []
        stop_reason = "max_new_tokens"
        while True:
            token = int(next_tokens(logits[:, -1], options, rng)[0])
            if token in stops:
                stop_reason = "stop_token"
                break
            out.append(token)
            if len(out) >= max_new_tokens:
                break
            mask = np.ones((1, mask.shape[1] + 1), np.int64)
            logits, past = b.decode(b.embed(np.array([[token]], np.int64)), mask,
                                    np.array([[mask.shape[1] - 1]], np.int64), past)
        self._finish(len(out), stop_reason)
        return out

    # study -> report: what the daemon and the CLI use ----------------------------------------------------------
    def report(self, study_path, prompt: str = "", options: GenerationOptions | None = None):
        """edgekit's `Report` for a study (DICOM file, series folder, zip or video) on the emulated X1."""
        from edgekit.reporter import Reporter

        if self._reporter is None:
            self._reporter = Reporter(self.bundle, backend=self.backend)
        self._begin()
        report = self._reporter.report(study_path, prompt, options)
        self._finish(int(report.timings.get("new_tokens", 0)), report.stop_reason)
        report.timings["x1"] = dict(self.last_stats)
        return report

    # accounting ----------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        self.backend.runs = []
        history = getattr(self.x1_backend, "history", None)
        if isinstance(history, list):  # a long-lived engine (the daemon) must not keep every run it ever made
            history.clear()
        if self.policy is not None:
            self.policy.reset()
            self.policy.reset_stats()

    def _finish(self, new_tokens: int, stop_reason: str) -> None:
        """`last_stats`: emulated cost of the last call, per phase and per token, and the DSS rate reached."""
        per_phase: dict[str, dict] = {}
        for phase, run in self.backend.runs:
            p = per_phase.setdefault(phase, {"calls": 0, "seconds": 0.0, "energy_j": 0.0, "cycles": 0.0})
            p["calls"] += 1
            p["seconds"] += _total(run, "seconds")
            p["energy_j"] += _total(run, "energy_j")
            p["cycles"] += _total(run, "cycles")
        decode = per_phase.get("decode", {"calls": 0, "seconds": 0.0, "energy_j": 0.0})
        # a decoded token costs its decoder call plus its embedding lookup; the prefill's token costs the prefill
        embeds = [r for ph, r in self.backend.runs if ph == "embed"]
        decode_embed_s = sum(_total(r, "seconds") for r in embeds[1:]) if decode["calls"] else 0.0
        decode_embed_j = sum(_total(r, "energy_j") for r in embeds[1:]) if decode["calls"] else 0.0
        steps = decode["calls"]
        total_s = sum(p["seconds"] for p in per_phase.values())
        total_j = sum(p["energy_j"] for p in per_phase.values())
        stats = {
            "tokens": new_tokens,
            "stop_reason": stop_reason,
            "decode_steps": steps,
            "emulated_ms_per_token": (decode["seconds"] + decode_embed_s) / steps * 1e3 if steps else 0.0,
            "mj_per_token": (decode["energy_j"] + decode_embed_j) / steps * 1e3 if steps else 0.0,
            "emulated_ms_total": total_s * 1e3,
            "mj_total": total_j * 1e3,
            "phases": {k: {"calls": v["calls"], "ms": v["seconds"] * 1e3, "mj": v["energy_j"] * 1e3}
                       for k, v in per_phase.items()},
            "kv_caching": self.config.enable_kv_caching,
            "sparsity_target": self.config.sparsity_target if self.config.dss_active else 0.0,
            "skip_rate": 0.0,
            "machine": {"name": self.machine.machine.name, "hash": self.machine.hash},
        }
        if self.policy is not None:
            stats["dss"] = self.policy.report()
            stats["skip_rate"] = self.policy.stats.skip_rate
        self.last_stats = stats

    @property
    def history(self) -> list:
        """(phase, RunResult) of every emulator run of the last call, for traces and reports."""
        return list(self.backend.runs)
